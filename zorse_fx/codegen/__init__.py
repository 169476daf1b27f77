"""Codegen: per-stage programs, their Python source, and fused messages."""

from .split import StageProgram, emit_source, flat_name, load_stage_class, load_stage_source, split_stages

__all__ = ["StageProgram", "split_stages", "emit_source", "load_stage_class", "load_stage_source", "flat_name"]
