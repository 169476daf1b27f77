"""Capture a model as an fx graph and cut it into blocks (see DESIGN.md)."""

from ..ir.tensor import TensorSpec
from .analysis import BlockGraph, analyse, low_precision_params
from .trace import CapturedModel, capture

__all__ = ["CapturedModel", "capture", "BlockGraph", "TensorSpec", "analyse", "low_precision_params"]
