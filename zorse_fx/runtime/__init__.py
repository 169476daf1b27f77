"""Runtime: executes an exported plan on torch.distributed (NCCL on GPU, Gloo on CPU)."""

from .schedule import Action, format_grid, gpipe, make_schedule, one_f_one_b, validate

__all__ = ["Action", "one_f_one_b", "gpipe", "make_schedule", "validate", "format_grid"]
