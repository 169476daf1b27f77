"""Capture a model as an fx graph and cut it into blocks (see DESIGN.md)."""

from ..ir.tensor import TensorSpec
from .analysis import BlockGraph, analyse, low_precision_params
from .trace import CapturedModel, capture, capture_lm

__all__ = ["CapturedModel", "capture", "capture_lm", "BlockGraph", "TensorSpec", "analyse", "low_precision_params"]
