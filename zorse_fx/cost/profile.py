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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["HARNESS_VERSION", "DeviceInfo", "KernelTiming", "KernelProfile"]

HARNESS_VERSION = "1"
_FORMAT = "zorse_fx.kernel_profile"


def _non_negative(d: dict, name: str, source: str) -> float:
    v = d.get(name, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"{source}: field {name!r} is {v!r}; expected a number >= 0 (ms), "
                         f"or leave it out for 0; re-run `zorse bench kernels` to measure it")
    return float(v)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """Where a profile was measured."""

    #: The cluster GPU type this profile describes (key in the GPU table or a
    #: cluster file's ``gpu_types``), e.g. "H100-80GB" or "cpu-x86-1thread".
    device_type: str
    #: What the device calls itself (``torch.cuda.get_device_name`` / CPU model).
    name: str
    backend: str  # "cuda" or "cpu"
    torch_version: str
    triton_version: str = ""
    cuda_version: str = ""
    driver_version: str = ""
    host: str = ""
    threads: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelTiming:
    """One measured operation."""

    key: str
    op_class: str  # matmul | attention | norm | softmax | elementwise | cross_entropy | embedding | copy
    impl: str  # "torch" (what the eager runtime runs) or "triton"
    dtype: str
    shape: dict
    fwd_ms: float
    bwd_ms: float | None
    flops: float  # forward FLOPs
    bytes: float  # forward bytes read + written
    source: str = "standard"  # "standard" sweep or "model" node replay

    @property
    def achieved_tflops(self) -> float:
        return self.flops / (self.fwd_ms * 1e-3) / 1e12 if self.fwd_ms > 0 else 0.0

    @property
    def achieved_gbps(self) -> float:
        return self.bytes / (self.fwd_ms * 1e-3) / 1e9 if self.fwd_ms > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelProfile:
    device: DeviceInfo
    measured_at: str
    #: Time of the cheapest measured op (per-op dispatch + launch), ms.
    overhead_ms: float
    entries: tuple[KernelTiming, ...]
    harness_version: str = HARNESS_VERSION
    notes: str = ""
    #: Whole-model fwd+bwd time / sum of its replayed node times, measured on a
    #: calibration model (autograd engine, gradient accumulation and cache
    #: effects that isolated replays miss). The cost model multiplies
    #: profiled node times by it.
    calibration: float = 1.0
    #: Micro-batch sizes of the model sweep (the cost model evaluates there).
    batch_sizes: tuple[int, ...] = ()
    #: AdamW step time per parameter (fp32 state), ns; 0 = not measured.
    optimizer_ns_per_param: float = 0.0
    #: Per computing node and micro-batch (forward + backward), ms: the part of
    #: a whole graph's measured time that its nodes' device times do not
    #: explain and that does not grow with the work (host dispatch the GPU
    #: waits for, gaps between kernels). Fitted with ``calibration`` from two
    #: or more whole-graph points (``kernels_main.calibrate_graph``); 0 = none.
    node_overhead_ms: float = 0.0
    by_key: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.by_key.update({(e.key, e.impl): e for e in self.entries})

    def lookup(self, key: str, impl: str = "torch") -> KernelTiming | None:
        return self.by_key.get((key, impl))

    def of_class(self, op_class: str, impl: str | None = None) -> list[KernelTiming]:
        return [e for e in self.entries if e.op_class == op_class and (impl is None or e.impl == impl)]

    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": 1,
            "harness_version": self.harness_version,
            "measured_at": self.measured_at,
            "device": asdict(self.device),
            "overhead_ms": self.overhead_ms,
            "notes": self.notes,
            "calibration": self.calibration,
            "batch_sizes": list(self.batch_sizes),
            "optimizer_ns_per_param": self.optimizer_ns_per_param,
            "node_overhead_ms": self.node_overhead_ms,
            "entries": [asdict(e) for e in self.entries],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "<dict>") -> "KernelProfile":
        if d.get("format") != _FORMAT:
            raise ValueError(f"{source}: field 'format' is {d.get('format')!r}, expected {_FORMAT!r}: not a kernel profile")
        if d.get("version") != 1:
            raise ValueError(f"{source}: kernel profile version {d.get('version')!r} unsupported (this zorse_fx reads 1); re-run `zorse bench kernels`")
        try:
            entries = []
            for i, e in enumerate(d["entries"]):
                if not (isinstance(e.get("fwd_ms"), (int, float)) and e["fwd_ms"] > 0):
                    raise ValueError(f"{source}: entries[{i}].fwd_ms must be a positive number, got {e.get('fwd_ms')!r}")
                entries.append(KernelTiming(**e))
            return cls(
                device=DeviceInfo(**d["device"]),
                measured_at=d["measured_at"],
                overhead_ms=float(d["overhead_ms"]),
                entries=tuple(entries),
                harness_version=d.get("harness_version", HARNESS_VERSION),
                notes=d.get("notes", ""),
                calibration=float(d.get("calibration", 1.0)),
                batch_sizes=tuple(int(b) for b in d.get("batch_sizes", ())),
                optimizer_ns_per_param=float(d.get("optimizer_ns_per_param", 0.0)),
                node_overhead_ms=_non_negative(d, "node_overhead_ms", source),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}") from exc
        except TypeError as exc:
            raise ValueError(f"{source}: malformed entry: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> "KernelProfile":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"{path}: no such profile; create one with `zorse bench kernels -o {path}`") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        return cls.from_dict(d, source=str(path))
