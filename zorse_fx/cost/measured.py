"""Cost model from measured kernel profiles, with a calibrated roofline fallback.

Time of one node on a device type, in order of preference:

1. ``exact``: the type's profile has the node's signature (measured by
   ``zorse bench kernels --model ...`` on this model's own shapes);
   profiled times (1 and 2) are multiplied by the profile's ``calibration``;
2. ``interpolated``: the profile has other shapes of the node's class; the
   time is interpolated piecewise-linearly in log(size) -> log(time), size =
   FLOPs (matmul, attention) or bytes (others); beyond the largest measured
   size time grows in proportion to size, below the smallest it stays at the
   smallest measured time (dispatch/launch floor);
3. ``roofline``: the type's profile has no entry of the node's class:
   datasheet roofline (``roofline.py``) with the efficiency of the class
   learned from every measured *GPU* profile (median achieved / peak); if no
   GPU profile is loaded, the assumed ``MATMUL_EFFICIENCY``/``MEMORY_EFFICIENCY``.

A type with no profile at all is priced by ``measured_block_costs`` as a plan
without profiles prices it (``base``: the class model), source ``"class model"``.

Matmul and attention timings are used only where they were measured in the
plan's compute dtype (``KernelTiming.dtype``): under a mixed precision plan
the runtime's autocast runs those ops in bfloat16/float16, so a float32
measurement of the captured (float32) model's own matmuls does not price
them; they fall to interpolation over the profile's entries in the compute
dtype, else to the roofline at that dtype's peak. Other classes are used
whatever their dtype.

A profiled type's block also pays, once per micro-batch, the accumulation of
its parameters' gradients into ``.grad`` (``grad_accumulate_ms``; node
replays return gradients and accumulate none), under a mixed policy the casts
of its weights' 16-bit gradients to float32 (``grad_cast_ms``; [Note: the
runtime's gradient work] in roofline.py) and ``node_overhead_ms`` per
computing node (what a whole graph's time has beyond its nodes' device times;
fitted with the calibration, ``kernels_main.calibrate_graph``).

A device type with neither a profile nor a datasheet row is an error (never
treated as a known one). Stage costs for the planner come from two micro-batch
sizes ``n1 < n2``: per-sample slope ``(T(n2) - T(n1)) / (n2 - n1)`` and fixed
part ``T(n1) - n1 * slope`` (clamped at 0).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..capture.analysis import BlockGraph
from ..cluster import GPUSpec
from ..ir.costs import FORWARD_SHARE, BlockCosts
from .profile import KernelProfile
from .replay import NodeCall, model_calls
from .opclass import size_metric
from .roofline import FWD_BWD_FACTOR, KERNEL_OVERHEAD_S, MATMUL_EFFICIENCY, MEMORY_EFFICIENCY

__all__ = ["ProfileSet", "NodeTime", "node_time", "measured_block_costs", "grad_accumulate_ms", "grad_cast_ms",
           "computing_nodes",
           "SHIPPED_PROFILES"]

#: Profiles shipped with zorse_fx (measured by the project; see bench/README.md).
SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "profiles"
_COMPUTE_CLASSES = ("matmul", "attention")


@dataclass(frozen=True, slots=True)
class NodeTime:
    fwd_ms: float
    bwd_ms: float
    source: str  # "exact" | "interpolated" | "roofline"


class ProfileSet:
    """Kernel profiles by device type, plus efficiencies learned from GPU profiles."""

    def __init__(self, profiles: list[KernelProfile]):
        self.by_type: dict[str, KernelProfile] = {}
        for p in profiles:
            if p.device.device_type in self.by_type:
                raise ValueError(f"two profiles for device type {p.device.device_type!r}; pass one")
            self.by_type[p.device.device_type] = p

    @classmethod
    def load(cls, paths=None) -> "ProfileSet":
        """Profiles from ``paths`` (files or directories); default: the shipped ones."""
        files: list[Path] = []
        for p in [SHIPPED_PROFILES] if paths is None else [Path(x) for x in paths]:
            files += sorted(p.glob("*.json")) if p.is_dir() else [p]
        return cls([KernelProfile.load(f) for f in files])

    def __contains__(self, device_type: str) -> bool:
        return device_type in self.by_type

    def learned_efficiency(self, op_cls: str, specs: dict[str, GPUSpec]) -> tuple[float, str]:
        """(efficiency, source) of ``op_cls`` against datasheet peaks, over GPU profiles."""
        ratios = []
        for t, prof in self.by_type.items():
            if prof.device.backend != "cuda" or t not in specs:
                continue
            spec = specs[t]
            for e in prof.of_class(op_cls, "torch"):
                if op_cls in _COMPUTE_CLASSES:
                    ratios.append(e.flops / (e.fwd_ms * 1e-3) / spec.peak_flops_per_s(e.dtype))
                elif e.bytes > 0:
                    ratios.append(e.bytes / (e.fwd_ms * 1e-3) / spec.mem_bw_bytes_per_s)
        if ratios:
            return min(1.0, statistics.median(ratios)), "learned"
        return (MATMUL_EFFICIENCY if op_cls in _COMPUTE_CLASSES else MEMORY_EFFICIENCY), "assumed"


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log-log; proportional above, floor below."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


def node_time(call: NodeCall, device_type: str, profiles: ProfileSet, spec: GPUSpec | None,
              specs: dict[str, GPUSpec], dtype: torch.dtype) -> NodeTime:
    """Forward and backward ms of ``call`` on ``device_type`` (see the module
    note); ``dtype``: the plan's compute dtype (matmul peaks, and which
    matmul/attention timings apply).

    Raises:
        ValueError: ``device_type`` has neither a profile nor a datasheet spec.
    """
    prof = profiles.by_type.get(device_type)
    if prof is not None:
        c = prof.calibration
        want = str(dtype).removeprefix("torch.")

        def usable(e) -> bool:  # matmul/attention: measured in the compute dtype (module docstring)
            return call.op_class not in _COMPUTE_CLASSES or e.dtype == want

        hit = prof.lookup(call.key, "torch")
        if hit is not None and usable(hit):
            return NodeTime(hit.fwd_ms * c, (hit.bwd_ms or 0.0) * c, "exact")
        same = [e for e in prof.of_class(call.op_class, "torch") if e.fwd_ms > 0 and usable(e)]
        if same:
            x = max(size_metric(call.op_class, call.flops, call.bytes), 1.0)
            fwd_pts = sorted({(max(size_metric(e.op_class, e.flops, e.bytes), 1.0), e.fwd_ms) for e in same})
            bwd_src = [e for e in same if e.bwd_ms]
            fwd = _interpolate(fwd_pts, x)
            if bwd_src:
                ratio = statistics.median(e.bwd_ms / e.fwd_ms for e in bwd_src)
                return NodeTime(fwd * c, fwd * ratio * c, "interpolated")
            return NodeTime(fwd * c, 0.0, "interpolated")
    if spec is None:
        raise ValueError(
            f"device type {device_type!r} has no measured profile and no datasheet entry; "
            f"run `zorse bench kernels -o profiles/{device_type}.json` on it or add it to the cluster's gpu_types"
        )
    eff, _ = profiles.learned_efficiency(call.op_class, specs)
    if call.op_class in _COMPUTE_CLASSES:
        t = call.flops / (spec.peak_flops_per_s(dtype) * eff)
    else:
        t = call.bytes / (spec.mem_bw_bytes_per_s * eff)
    fwd = t + KERNEL_OVERHEAD_S
    return NodeTime(fwd * 1e3, fwd * (FWD_BWD_FACTOR - 1) * 1e3, "roofline")


def grad_accumulate_ms(prof: KernelProfile, numel: int, itemsize: int = 4) -> float:
    """ms to add one micro-batch's gradient of ``numel`` elements into ``.grad``
    (read both, write one: ``3 * itemsize * numel`` bytes) on ``prof``'s device:
    interpolated over its measured elementwise entries by bytes; 0 if it has none.

    Node replays time each node's backward with ``torch.autograd.grad``, which
    returns gradients and accumulates none; the runtime's backward adds every
    parameter's gradient into ``.grad`` (one float32 add kernel per parameter;
    measured on an H200, bench/README.md "One H200 measured")."""
    pts = sorted({(max(e.bytes, 1.0), e.fwd_ms) for e in prof.of_class("elementwise", "torch") if e.fwd_ms > 0})
    return _interpolate(pts, 3.0 * itemsize * numel) if pts else 0.0


def grad_cast_ms(prof: KernelProfile, numel: int, itemsize16: int = 2, itemsize: int = 4) -> float:
    """ms to cast one micro-batch's 16-bit gradient of ``numel`` elements to float32 (the backward of
    autocast's weight cast: ``(itemsize16 + itemsize) * numel`` bytes, [Note: the runtime's gradient
    work] in roofline.py) on ``prof``'s device, interpolated as ``grad_accumulate_ms``; 0 if it has none."""
    pts = sorted({(max(e.bytes, 1.0), e.fwd_ms) for e in prof.of_class("elementwise", "torch") if e.fwd_ms > 0})
    return _interpolate(pts, float((itemsize16 + itemsize) * numel)) if pts else 0.0


def computing_nodes(bg: BlockGraph, batch: int = 1) -> int:
    """How many nodes of ``bg``'s blocks the cost model times (``model_calls``):
    what ``KernelProfile.node_overhead_ms`` is charged per."""
    calls = model_calls(bg.captured, batch)
    return sum(name in calls for b in range(bg.num_blocks) for name in bg.block_nodes(b))


def measured_block_costs(
    bg: BlockGraph,
    specs: dict[str, GPUSpec | None],
    profiles: ProfileSet,
    *,
    batches: tuple[int, int],
    base: BlockCosts,
    compute_dtype: torch.dtype = torch.float32,
    cast_params: frozenset[str] | None = None,
) -> tuple[BlockCosts, dict[str, Counter]]:
    """Per-block per-sample and fixed times from profiles, at micro-batches ``batches``.

    ``base`` (``roofline.block_costs``) supplies parameters, activation and
    cut bytes and bytes per parameter, which do not depend on the timing
    source, and the times of every type in ``specs`` without a profile: a
    table GPU beside a profiled one is priced as in a plan with no profile
    (the class model of ``gpu_model``, source ``"class model"``), not by a
    roofline scaled from the other GPU's profile. ``compute_dtype``: the
    plan's (``PrecisionPolicy.compute_dtype``); ``cast_params``: the weights autocast casts
    (``SavedActivations.cast_params``; None: every trainable one where ``compute_dtype`` is 16-bit),
    whose gradient casts a profiled type's blocks pay per micro-batch besides the accumulation
    ([Note: the runtime's gradient work] in roofline.py). Returns the costs and, per
    device type, how many node times came from each source.

    Raises:
        ValueError: a type has neither a profile nor a datasheet spec.
    """
    n1, n2 = batches
    if not 1 <= n1 < n2:
        raise ValueError(f"batches must satisfy 1 <= n1 < n2, got {batches}")
    calls = {n: model_calls(bg.captured, n) for n in (n1, n2)}
    known = {t: s for t, s in specs.items() if s is not None}
    per_sample: dict[str, tuple[float, ...]] = {}
    fixed: dict[str, tuple[float, ...]] = {}
    fwd_per_sample: dict[str, tuple[float, ...]] = {}
    fwd_fixed: dict[str, tuple[float, ...]] = {}
    sources: dict[str, Counter] = {}
    state, trainable = bg.captured.state(), bg.captured.trainable()
    c16 = torch.empty((), dtype=compute_dtype).element_size()
    cast = (frozenset() if c16 == 4 else frozenset(trainable) if cast_params is None
            else cast_params)  # gradient casts ([Note: the runtime's gradient work])
    readers = Counter(a for b in range(bg.num_blocks) for a in bg.block_attrs[b])
    for dev_type, spec in specs.items():
        prof = profiles.by_type.get(dev_type)
        if prof is None and spec is not None and dev_type in base.fwd_bwd_s_per_sample:
            per_sample[dev_type] = base.fwd_bwd_s_per_sample[dev_type]
            fixed[dev_type] = base.fixed_s(dev_type)
            fwd_per_sample[dev_type] = base.forward_s_per_sample(dev_type)
            fwd_fixed[dev_type] = base.forward_s_fixed(dev_type)
            sources[dev_type] = Counter({"class model": sum(name in calls[n] for n in (n1, n2)
                                                            for b in range(bg.num_blocks)
                                                            for name in bg.block_nodes(b))})
            continue
        cache: dict[str, NodeTime] = {}
        count: Counter = Counter()
        slopes, fixeds, fwd_slopes, fwd_fixeds = [], [], [], []
        calibration = prof.calibration if prof is not None else 1.0
        accumulate = [sum(grad_accumulate_ms(prof, state[a].numel(), state[a].element_size())
                          + (grad_cast_ms(prof, state[a].numel(), c16, state[a].element_size()) / readers[a]
                             if a in cast else 0.0)
                          for a in bg.block_attrs[b] if a in trainable) if prof is not None else 0.0
                      for b in range(bg.num_blocks)]
        overhead = [(prof.node_overhead_ms * sum(name in calls[n1] for name in bg.block_nodes(b))
                     if prof is not None else 0.0) for b in range(bg.num_blocks)]
        for b in range(bg.num_blocks):
            totals, forwards = [], []
            for n in (n1, n2):
                total = forward = 0.0
                for name in bg.block_nodes(b):
                    call = calls[n].get(name)
                    if call is None:
                        continue
                    if call.key not in cache:
                        cache[call.key] = node_time(call, dev_type, profiles, spec, known, compute_dtype)
                    nt = cache[call.key]
                    count[nt.source] += 1
                    total += (nt.fwd_ms + nt.bwd_ms) * 1e-3
                    forward += nt.fwd_ms * 1e-3
                totals.append(total)
                forwards.append(forward)
            slope = max(0.0, (totals[1] - totals[0]) / (n2 - n1))
            slopes.append(slope)
            fixeds.append(max(0.0, totals[0] - n1 * slope) + (accumulate[b] * calibration + overhead[b]) * 1e-3)
            # The forward's part, fitted alike: gradient accumulation is backward work; a node's
            # dispatch overhead is paid per kernel, and the backward launches about two per forward
            # one (FORWARD_SHARE of it). Kept within the totals (an interpolated backward may not grow).
            f_slope = min(slope, max(0.0, (forwards[1] - forwards[0]) / (n2 - n1)))
            fwd_slopes.append(f_slope)
            fwd_fixeds.append(min(fixeds[-1], max(0.0, forwards[0] - n1 * f_slope)
                                  + FORWARD_SHARE * overhead[b] * 1e-3))
        per_sample[dev_type] = tuple(slopes)
        fixed[dev_type] = tuple(fixeds)
        fwd_per_sample[dev_type] = tuple(fwd_slopes)
        fwd_fixed[dev_type] = tuple(fwd_fixeds)
        sources[dev_type] = count
    return dataclasses.replace(base, fwd_bwd_s_per_sample=per_sample, fwd_bwd_s_fixed=fixed,
                               fwd_s_per_sample=fwd_per_sample, fwd_s_fixed=fwd_fixed), sources
