"""The shape and dtype of a tensor that crosses a stage boundary or enters the
model, per sample (the batch dimension left out)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta

if TYPE_CHECKING:
    from ..precision import PrecisionPolicy

__all__ = ["TensorSpec", "ITEMSIZE", "TensorDtype", "on_wire", "as_run"]

#: Bytes per element of the dtypes a captured graph's batch-major tensors may take
#: (``torch.<name>.itemsize``, checked against torch in tests/test_ir.py); its keys are
#: the dtypes plan.json accepts (``TensorDtype``).
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "complex64": 8, "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

#: A dtype name of ``ITEMSIZE`` (``str(torch dtype)`` without ``torch.``).
TensorDtype = Literal[tuple(ITEMSIZE)]  # type: ignore[valid-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """A batch-major tensor: full shape is ``(n, *shape_per_sample)``.

    The annotations are also plan.json's schema of a stage's ``recv``/``send``
    entries (``file_schema.struct_of``)."""

    #: The tensor's name in the captured graph.
    name: str
    shape_per_sample: Annotated[tuple[Annotated[int, Meta(ge=0)], ...],
                                Meta(description="the tensor's shape without the batch dimension")]
    #: Its dtype's name as torch spells it (``torch.float32`` -> "float32").
    dtype: TensorDtype

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``; raises ``ValueError`` for a dtype outside ``ITEMSIZE``."""
        try:
            return ITEMSIZE[self.dtype]
        except KeyError:
            raise ValueError(f"TensorSpec {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}") \
                from None

    @property
    def bytes_per_sample(self) -> int:
        numel = 1
        for d in self.shape_per_sample:
            numel *= d
        return numel * self.itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "shape_per_sample": list(self.shape_per_sample), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(name=d["name"], shape_per_sample=tuple(d["shape_per_sample"]), dtype=d["dtype"])


def on_wire(specs, precision: "PrecisionPolicy") -> tuple[TensorSpec, ...]:
    """``specs`` (what a stage computes) as they cross the boundary under
    ``precision``: float32 in the compute dtype of a mixed policy
    (``PrecisionPolicy.wire_dtype_name``, [Note: 16-bit boundary tensors] in
    ``zorse_fx/precision.py``), the rest unchanged. The one rule the planner
    prices and the runtime sends by."""
    return tuple(replace(s, dtype=precision.wire_dtype_name(s.dtype)) for s in specs)


def as_run(specs, planned: str, precision: "PrecisionPolicy") -> tuple[TensorSpec, ...]:
    """``specs`` as a plan priced under precision ``planned`` recorded them, in
    the dtypes a stage computes when it trains under ``precision``
    (``PrecisionPolicy.run_dtype_name``: a tensor recorded in the planned
    autocast dtype follows the run's; a float16-mixed plan trained in fp32
    receives float32). ``on_wire`` of these is what travels."""
    return tuple(replace(s, dtype=precision.run_dtype_name(s.dtype, planned)) for s in specs)
