"""Capture a model as an fx graph and cut it into blocks (see DESIGN.md)."""

from ..ir.tensor import TensorSpec
from .analysis import BlockGraph, analyse
from .trace import CapturedModel, capture

__all__ = ["CapturedModel", "capture", "BlockGraph", "TensorSpec", "analyse"]
