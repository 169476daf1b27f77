"""Kernel profiles: measured times per (operation, shape, dtype) on one device type.

A profile is JSON (``"format": "zorse_fx.kernel_profile"``, version 1)::

    {"device": {"device_type": "H100-80GB", "name": "NVIDIA H100 80GB HBM3", ...},
     "harness_version": "1", "measured_at": "2026-11-22T06:10:00Z",
     "overhead_ms": 0.004,                     # smallest op, dispatch + launch
     "calibration": 1.06, "node_overhead_ms": 0.014,   # whole graph = cal * nodes + overhead * nodes
     "entries": [{"key": "aten.linear.default(f32[64,576],f32[1536,576])",
                  "op_class": "matmul", "impl": "torch", "dtype": "float32",
                  "shape": {"M": 64, "N": 1536, "K": 576},
                  "fwd_ms": 0.21, "bwd_ms": 0.40, "flops": 1.1e8, "bytes": 4.1e6}, ...]}

``key`` is the exact node signature for entries measured from a model's own
nodes (``source: "model"``), or ``<op>(<shape>)`` for the standard sweep.
Only the profiling harness touches the device; the cost model reads these
files.

The format is declared once, on the dataclasses below: their annotations
carry each field's type, range (``Meta(gt=0)``, ...), allowed values
(``Literal``) and meaning (``Meta(description=...)``), and
``file_schema.struct_of`` builds the schema (``KernelProfileDoc``) from them.
Fields marked ``OPTIONAL`` may be left out of a file (files written before
they existed) and take their defaults. ``KernelProfile.load`` / ``from_dict``
check a file against the schema (``KERNEL_PROFILE_FILE``, unknown fields
refused) and raise ``errors.ProfileFileError`` (a ``FileFormatError`` and a
``ValueError``) naming the file, the field path (``entries[3].fwd_ms``), the
value, what was expected and the fix; ``to_dict`` / ``save`` write the
fields in the schema's order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..errors import ProfileFileError
from ..file_schema import NOT_IN_FILE, OPTIONAL, FileFormat, from_doc, struct_of, to_builtins

__all__ = ["HARNESS_VERSION", "OP_CLASSES", "DeviceInfo", "KernelTiming", "KernelProfile", "KernelProfileDoc",
           "KERNEL_PROFILE_FILE"]

HARNESS_VERSION = "1"
_FORMAT = "zorse_fx.kernel_profile"
_VERSION = 1
#: The operation classes of ``cost.opclass.op_class`` (what an entry's ``op_class`` may be).
OP_CLASSES = ("matmul", "attention", "norm", "softmax", "elementwise", "cross_entropy", "embedding", "copy")

# Field types of a kernel profile, read by the schema for the ranges and the meaning its errors quote.
Ms = Annotated[float, Meta(ge=0)]  # a time in milliseconds, >= 0
OpClass = Literal[OP_CLASSES]  # type: ignore[valid-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """Where a profile was measured."""

    #: The cluster GPU type this profile describes (key in the GPU table or a
    #: cluster file's ``gpu_types``), e.g. "H100-80GB" or "cpu-x86-1thread".
    device_type: Annotated[str, Meta(description="the cluster GPU type the profile describes, e.g. 'H100-80GB'")]
    #: What the device calls itself (``torch.cuda.get_device_name`` / CPU model).
    name: Annotated[str, Meta(description="the device's own name")]
    backend: Literal["cuda", "cpu"]
    torch_version: str
    triton_version: str = field(default="", metadata=OPTIONAL)
    cuda_version: str = field(default="", metadata=OPTIONAL)
    driver_version: str = field(default="", metadata=OPTIONAL)
    host: str = field(default="", metadata=OPTIONAL)
    threads: Annotated[int, Meta(ge=1, description="CPU threads the harness ran with")] = field(
        default=1, metadata=OPTIONAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelTiming:
    """One measured operation (times in ms, work in FLOPs and bytes)."""

    key: Annotated[str, Meta(description="the node signature, or <op>(<shape>) for the standard sweep")]
    op_class: OpClass
    impl: Literal["torch", "triton"]  # "torch" (what the eager runtime runs) or "triton"
    dtype: Annotated[str, Meta(description="the compute dtype, e.g. 'float32'")]
    shape: Annotated[dict[str, int | float | bool | str], Meta(
        description="the sweep's shape parameters, name -> value; {} for a model node")]
    fwd_ms: Annotated[float, Meta(gt=0, description="forward time, ms, > 0")]
    bwd_ms: Annotated[float | None, Meta(description="backward time, ms (null: not measured)")]
    flops: Annotated[float, Meta(ge=0, description="forward FLOPs")]
    bytes: Annotated[float, Meta(ge=0, description="forward bytes read + written")]
    source: Literal["standard", "model"] = field(default="standard", metadata=OPTIONAL)

    @property
    def achieved_tflops(self) -> float:
        return self.flops / (self.fwd_ms * 1e-3) / 1e12 if self.fwd_ms > 0 else 0.0

    @property
    def achieved_gbps(self) -> float:
        return self.bytes / (self.fwd_ms * 1e-3) / 1e9 if self.fwd_ms > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelProfile:
    """The measured kernels of one device type (fields in the file's order)."""

    harness_version: str = field(default=HARNESS_VERSION, metadata=OPTIONAL)
    measured_at: Annotated[str, Meta(description="an ISO 8601 date-time, e.g. '2026-11-22T06:10:00Z'")]
    device: DeviceInfo
    #: Time of the cheapest measured op (per-op dispatch + launch), ms.
    overhead_ms: Annotated[Ms, Meta(description="time of the cheapest measured op (dispatch + launch), ms")]
    notes: str = field(default="", metadata=OPTIONAL)
    #: Whole-model fwd+bwd time / sum of its replayed node times, measured on a
    #: calibration model (autograd engine, gradient accumulation and cache
    #: effects that isolated replays miss). The cost model multiplies
    #: profiled node times by it.
    calibration: Annotated[float, Meta(gt=0, description="whole-model time / sum of its node times, > 0")] = field(
        default=1.0, metadata=OPTIONAL)
    #: Micro-batch sizes of the model sweep (the cost model evaluates there).
    batch_sizes: Annotated[tuple[Annotated[int, Meta(ge=1)], ...], Meta(
        description="micro-batch sizes of the model sweep, each >= 1")] = field(default=(), metadata=OPTIONAL)
    #: AdamW step time per parameter (fp32 state), ns; 0 = not measured.
    optimizer_ns_per_param: Annotated[float, Meta(ge=0, description="AdamW step time per parameter, ns; 0 = not "
                                                                   "measured")] = field(default=0.0, metadata=OPTIONAL)
    #: Per computing node and micro-batch (forward + backward), ms: the part of
    #: a whole graph's measured time that its nodes' device times do not
    #: explain and that does not grow with the work (host dispatch the GPU
    #: waits for, gaps between kernels). Fitted with ``calibration`` from two
    #: or more whole-graph points (``kernels_main.calibrate_graph``); 0 = none.
    node_overhead_ms: Annotated[Ms, Meta(description="ms per computing node and micro-batch; leave it out for 0")] = (
        field(default=0.0, metadata=OPTIONAL))
    entries: tuple[KernelTiming, ...]
    by_key: dict = field(default_factory=dict, compare=False, repr=False, metadata=NOT_IN_FILE)

    def __post_init__(self) -> None:
        self.by_key.update({(e.key, e.impl): e for e in self.entries})

    def lookup(self, key: str, impl: str = "torch") -> KernelTiming | None:
        return self.by_key.get((key, impl))

    def of_class(self, op_class: str, impl: str | None = None) -> list[KernelTiming]:
        return [e for e in self.entries if e.op_class == op_class and (impl is None or e.impl == impl)]

    def to_dict(self) -> dict:
        """The JSON-ready dict of this profile (the file's content), keys in
        the schema's order, ``format`` and ``version`` first."""
        return to_builtins(self, KernelProfileDoc, _file_only)

    def save(self, path: str | Path) -> Path:
        """Write ``to_dict`` to ``path`` (JSON, indent 1; parent directories made); returns ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> KernelProfile:
        """The profile of ``d`` (a parsed profile file) checked against the
        schema. Raises ProfileFileError naming ``source``, the field, the
        value and the fix."""
        return from_doc(KERNEL_PROFILE_FILE.decode(d, source), cls)

    @classmethod
    def load(cls, path: str | Path) -> KernelProfile:
        """The profile in the JSON file ``path``. Raises ProfileFileError: no
        such file, not JSON, or a field the schema refuses."""
        _, doc = KERNEL_PROFILE_FILE.read(path, missing=f"create one with `zorse bench kernels -o {path}`")
        return from_doc(doc, cls)


def _file_only(record: Any) -> dict:
    """The fields a profile file holds that ``KernelProfile`` does not."""
    return {"format": _FORMAT, "version": _VERSION} if isinstance(record, KernelProfile) else {}


DeviceInfoDoc = struct_of(DeviceInfo, "DeviceInfoDoc")
KernelTimingDoc = struct_of(KernelTiming, "KernelTimingDoc")
KernelProfileDoc = struct_of(KernelProfile, "KernelProfileDoc", docs={DeviceInfo: DeviceInfoDoc,
                                                                      KernelTiming: KernelTimingDoc}, extra={
    "": [("format", Literal["zorse_fx.kernel_profile"], msgspec.NODEFAULT), ("version", Literal[1], msgspec.NODEFAULT)],
})

#: A kernel profile as a ``file_schema.FileFormat``.
KERNEL_PROFILE_FILE = FileFormat(name=_FORMAT, what="kernel profile", doc=KernelProfileDoc, versions=(_VERSION,),
                                 remake="re-run `zorse bench kernels`", error=ProfileFileError)
