"""The integer tables of the planners' cost model (objective.py's module note
"step-time model", its section "Integer arithmetic"): the time, memory and
bucket units, and ``build_tables``, which rounds every coefficient of one
(cluster, model, micro-batch count) once so that ``evaluate``, the CP-SAT
model and brute force compute the same integers. Split from objective.py,
which re-exports every name here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.buckets import bucket_caps
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..options import SCHEDULES, PlanOptions
from .network_terms import effective_pair_bandwidth, pair_row_codes

__all__ = ["UNITS_PER_S", "UNIT_S", "MEMORY_UNIT_BYTES", "MIB_UNITS",
           "GRAD_BUCKET_BYTES_PER_PARAM", "BUCKET_UNIT_BYTES", "LAST_BUCKET_RESOLUTION", "GIB", "bucket_count",
           "to_units", "IntTables", "build_tables", "drain_coefficients", "control_units", "control_pass",
           "control_pass_s"]

#: Integer time units per second: 1 unit = 1 ns.
UNITS_PER_S = 1_000_000_000
#: Seconds per integer time unit.
UNIT_S = 1.0 / UNITS_PER_S
#: Bytes per integer memory unit of the tables (KiB; see the module note).
MEMORY_UNIT_BYTES = 1024
#: Memory units per MiB: optimizer-state shards are decided in whole MiB.
MIB_UNITS = 1024
#: Bytes of one gradient element in a bucket: the runtime's buckets hold the
#: float32 master gradients (``runtime/grad_sync.py``; ``sim/sync.py``'s _FP32).
GRAD_BUCKET_BYTES_PER_PARAM = 4
#: Bytes per unit of the bucket-count tables (KiB; [C-allreduce], module note).
BUCKET_UNIT_BYTES = 1024
#: Least coefficient of the last bucket's table (``IntTables.lastb_coef``, [C-objective]):
#: its per-KiB ring time on NVLink is ~2-20 ns, so whole ns would round it by up to 25%;
#: each class counts in 1/2^i ns enough for a rounding error < 0.05%. Per class, not one
#: fine unit for all: 1/1024 ns per KiB on a 2 GB/s link made the coefficients ~3e10
#: and OR-Tools 9.15's presolve returned a wrong "OPTIMAL" (test_solver seed 30).
LAST_BUCKET_RESOLUTION = 1024


#: [C-offload] host bytes per offloaded parameter: AdamW's two float32 moments and the float32
#: master weight (a 16-bit working weight's master, or the host copy of a float32 weight) = 12.
OFFLOAD_BYTES_PER_PARAM = 12
#: [C-offload] bytes per parameter over the host link each step: its float32 gradient to the host
#: (4) and its updated weight back (4: float32, an upper bound for a 16-bit working weight).
OFFLOAD_LINK_BYTES = 8


def bucket_count(grad_units: int, caps: tuple[int, int]) -> int:
    """nb = 1 + max(0, ceil((G - first_cap) / cap)): the gradient buckets of
    an all-reduce of G units of float32 gradients, ``caps`` = (first_cap, cap)
    in the same units (``IntTables.bucket_caps``; [C-allreduce])."""
    first, cap = caps
    return 1 + max(0, -(-(grad_units - first) // cap))


def _kib_up(nbytes: float) -> int:
    return -(-int(nbytes) // MEMORY_UNIT_BYTES)
GIB = float(1 << 30)


def to_units(seconds: float) -> int:
    """Round a duration in seconds to the nearest integer time unit (ns)."""
    return int(round(seconds * UNITS_PER_S))


def _prefix(values) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class IntTables:
    """Integer coefficients of the model for one micro-batch count M.

    Times in units (ns), sizes in bytes. Prefix arrays have B+1 entries:
    the value of blocks [i, j) is ``prefix[j] - prefix[i]``."""

    num_blocks: int
    num_gpus: int
    num_microbatches: int
    microbatch_size: int
    schedule: str
    gpu_types: tuple[str, ...]
    #: {gpu_type: prefix of per-sample fwd+bwd units}.
    work_prefix: dict[str, tuple[int, ...]]
    #: {gpu_type: prefix of fixed per-micro-batch fwd+bwd units}.
    fixed_prefix: dict[str, tuple[int, ...]]
    #: prefix of state (state_bytes_per_param * params) and of activations per sample,
    #: in MEMORY_UNIT_BYTES units.
    state_prefix: tuple[int, ...]
    act_prefix: tuple[int, ...]
    #: (G, G) index into ``bw_values`` (ascending distinct link bandwidths, B/s); -1 on the diagonal.
    pair_bw_class: tuple[tuple[int, ...], ...]
    bw_values: tuple[float, ...]
    #: (G, G) link latency units (max of both directions).
    pair_lat: tuple[tuple[int, ...], ...]
    #: [bw class][cut c] units of cut_bytes[c] / bw: one sample, one direction ([C-boundary]).
    xfer1: tuple[tuple[int, ...], ...]
    #: b * xfer1: the whole micro-batch on one link (the stage DP's and interleave pass's upper bound).
    xfer: tuple[tuple[int, ...], ...]
    #: (G,) node index of each GPU; (G, G) [Note: boundary rows] code of each pair (-1 on the diagonal).
    gpu_node: tuple[int, ...]
    pair_rows: tuple[tuple[int, ...], ...]
    #: [bw class] prefix of per-block all-reduce units 2 * grad_bytes * params / bw.
    ar_prefix: tuple[tuple[int, ...], ...]
    #: prefix of per-block float32 gradient bytes (GRAD_BUCKET_BYTES_PER_PARAM * params) in
    #: BUCKET_UNIT_BYTES units, rounded up per block ([C-allreduce]'s bucket count).
    grad_kib_prefix: tuple[int, ...]
    #: Per tied parameter: its float32 gradient bytes in BUCKET_UNIT_BYTES units, rounded down.
    tied_grad_kib: tuple[int, ...]
    #: [Note: gradient transients] (state_terms.py): per block its largest parameter's float32 gradient,
    #: per tied parameter three of its float32 gradients, KiB (rounded up; empty: not known).
    gt_kib: tuple[int, ...] = ()
    tied_gt3_kib: tuple[int, ...] = ()
    #: (first bucket's cap, every other bucket's cap) in BUCKET_UNIT_BYTES units
    #: (``ir.buckets.bucket_caps(options.bucket_bytes)``, as the runtime's buckets).
    bucket_caps: tuple[int, int]
    #: (G,) index into ``mem_bw_values``; [class] prefix of 2 * optimizer bytes / mem_bw units.
    gpu_mbw_class: tuple[int, ...]
    mem_bw_values: tuple[float, ...]
    opt_prefix: tuple[tuple[int, ...], ...]
    #: (G,) usable memory floor(memory_fraction * memory_bytes), in MEMORY_UNIT_BYTES units.
    cap_bytes: tuple[int, ...]
    #: prefix of the shardable state Q (``BlockCosts.shardable_bytes``, KiB,
    #: rounded up per block); the replicated rest of a stage is state_prefix - shard_prefix.
    shard_prefix: tuple[int, ...]
    #: (B+1,) cut bytes per sample before block c as the stage holds them (KiB, rounded up;
    #: ``BlockCosts.cut_run_bytes_per_sample``: float32 under a mixed policy, where the wire's
    #: ``cut_bytes_per_sample`` are 16-bit): the memory terms' X_s; transfers use the wire's.
    cut_kib: tuple[int, ...]
    #: {gpu_type: prefix of forward units per sample / per micro-batch}
    #: (``BlockCosts.forward_s_per_sample`` / ``forward_s_fixed``, rounded per
    #: block): the F task of the schedule, and the re-run forward of a
    #: recomputing stage ([C-recompute]).
    rc_work_prefix: dict[str, tuple[int, ...]]
    rc_fixed_prefix: dict[str, tuple[int, ...]]
    #: [bw class] prefix of a sharded stage's sync units (2 grad * params + ``gather_bytes``) / bw.
    arsh_prefix: tuple[tuple[int, ...], ...]
    #: [memory-bandwidth class] optimizer units per MiB of shard, at float32's
    #: ``2 x optim_bytes / shardable_bytes_per_param`` (4 per shard byte): an upper
    #: bound for a shard of 16-bit working weights, whose step moves about 34 B per
    #: 12 B of shard ([Note: 16-bit working weights]).
    opt_per_mib: tuple[int, ...]
    #: Per tied parameter (``BlockCosts.tied_params``): the blocks that read it
    #: (ascending) and [bw class] units of its gradient all-reduce 2 * grad_bytes
    #: * numel / bw, before the ring's (k-1)/k ([C-tied]).
    tied_blocks: tuple[tuple[int, ...], ...] = ()
    tied_ar: tuple[tuple[int, ...], ...] = ()
    #: Per tied parameter: one copy's state and shardable state (KiB, rounded
    #: DOWN) and [memory-bandwidth class] optimizer units 2 * optim_bytes *
    #: numel / mem_bw, which a stage holding c >= 2 of its blocks counts
    #: c - 1 times less ([C-tied]; ``state_terms.py``).
    tied_state: tuple[int, ...] = ()
    tied_shard: tuple[int, ...] = ()
    tied_opt: tuple[tuple[int, ...], ...] = ()
    #: [bw class] 1/lastb_scale[class] ns per KiB of a float32 gradient bucket's ring
    #: pass, 2 * grad_bytes * (BUCKET_UNIT_BYTES / 4) / bw (the last bucket of [C-objective]);
    #: lastb_scale = the least power of two making it >= LAST_BUCKET_RESOLUTION (1 if none).
    lastb_coef: tuple[int, ...] = ()
    lastb_scale: tuple[int, ...] = ()
    #: [C-objective]'s drain coefficients in sixths of a stage's compute
    #: (``drain_coefficients``): (k_E, k_B, k_Brc) -- E_s = sum_{j<s} (k_E
    #: cmax_j + 3 boundary_j), B6_s = k_B cmax-_s (k_Brc when recomputing);
    #: (4, 4, 3) with the backward at twice the forward.
    drain_coefs: tuple[int, int, int] = (4, 4, 3)
    sharding: str = "never"
    #: ``PlanOptions.grad_sharding`` ([C-grad-shard]).
    grad_sharding: str = "never"
    #: ``PlanOptions.param_sharding`` ([C-param-shard]).
    param_sharding: str = "never"
    recompute: str = "never"
    #: ``PlanOptions.offload`` ([C-offload]).
    offload: str = "never"
    #: [C-offload]: prefix of the host state of an offloaded stage, OFFLOAD_BYTES_PER_PARAM
    #: per parameter (KiB, rounded up per block); per tied parameter one copy's (rounded down).
    host_prefix: tuple[int, ...] = ()
    tied_host: tuple[int, ...] = ()
    #: [C-offload]: prefix of what a replicated (unsharded) offloaded stage keeps on each GPU,
    #: (state_bytes_per_param - shardable_bytes_per_param) per parameter, KiB rounded up per block;
    #: per tied parameter one copy's (rounded down). Only a sharded stage of >= 2 GPUs has 16-bit
    #: working weights (``plan_build``), so every weight of a replicated one stays float32 on the GPU.
    off_rep_prefix: tuple[int, ...] = ()
    tied_off_rep: tuple[int, ...] = ()
    #: (G,) host memory a GPU may offload to: floor(memory_fraction x its share of its node's
    #: ``host_memory_GiB``), KiB (0: none).
    host_cap: tuple[int, ...] = ()
    #: (G,) units per MiB of offloaded host state: the step's host-link and CPU time
    #: (OFFLOAD_LINK_BYTES / host link + 2 x optim_bytes / host memory bandwidth per parameter).
    off_per_mib: tuple[int, ...] = ()
    #: (G,) [C-act-offload] units per MiB of saved activations moved to host memory and back
    #: (2 x MiB / host link; 0: no host link).
    act_per_mib: tuple[int, ...] = ()
    #: [C-control] passes of the world's ring per step (``BlockCosts.step_control_rounds``), the largest
    #: latency units over every GPU pair, and one pass over every GPU (``control_pass``).
    control_rounds: int = 0
    world_lat: int = 0
    world_pass: int = 0
    #: (G,) each GPU's datacenter index (``DeviceGraph.datacenter_index``; [C-control]).
    gpu_dc: tuple[int, ...] = ()
    #: ``BlockCosts.step_overhead_s`` in units: added to [C-control] (a calibration's measured loop overhead).
    step_overhead: int = 0

    @property
    def cut_kib_max(self) -> int:
        return max(self.cut_kib)


def drain_coefficients(forward_share_max: float) -> tuple[int, int, int]:
    """(k_E, k_B, k_Brc) of ``IntTables.drain_coefs`` for blocks whose forward is
    at most ``forward_share_max`` (phi) of their forward + backward
    (``BlockCosts.forward_share_max``). A stage's backward is then >= (1 - phi)
    of its compute, and with recomputation (compute = fwd+bwd + the re-run
    forward, the backward task both) >= 1/(1 + phi) >= 1 - phi of it: k_E =
    floor(6 (1 - phi)); the backward of the blocks but the last, after the
    re-run: (1 - phi) of their compute, (1 - phi)/(1 + phi) when recomputing.
    Each floored to sixths and capped at the 1:2 split's (4, 4, 3), which the
    drain offsets were measured with (``network_terms.drain_offsets``),
    so a different split only ever lowers the overlap credited."""
    phi = min(max(forward_share_max, 0.0), 1.0)
    eps = 1e-9  # 6 (1 - 1/3) is 3.9999... in floats
    return (min(4, int(6 * (1 - phi) + eps)), min(4, int(6 * (1 - phi) + eps)),
            min(3, int(6 * (1 - phi) / (1 + phi) + eps)))


def build_tables(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                 num_microbatches: int) -> IntTables:
    """Round every coefficient of the model once for ``num_microbatches`` = M
    (objective.py's module note, "Integer arithmetic"): times in ns, memory in
    KiB, per-block tables as prefix sums over the B blocks, per-pair tables
    (G, G).

    Raises ValueError when M does not divide the global batch, the schedule is
    unknown, a GPU type has no block times, a memory bandwidth or link
    bandwidth is not > 0, or the gradient bucket caps are not whole KiB."""
    gbs, m = options.global_batch_size, num_microbatches
    if m < 1 or gbs % m:
        raise ValueError(f"num_microbatches={m} does not divide global_batch_size={gbs}")
    if options.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {options.schedule!r}")
    b, n_g = gbs // m, devices.num_gpus
    missing = sorted(set(devices.gpu_types) - set(costs.fwd_bwd_s_per_sample))
    if missing:
        raise ValueError(f"BlockCosts.fwd_bwd_s_per_sample has no times for GPU type(s) {missing}")
    for g in range(n_g):
        if devices.mem_bw_bytes_per_s[g] <= 0:
            raise ValueError(f"GPU {g}: mem_bw_bytes_per_s must be > 0, got {devices.mem_bw_bytes_per_s[g]}")
    pair_bw_class, bw_values, pair_lat, gpu_node, pair_rows = _pair_tables(devices)
    mem_bw_values = tuple(sorted(set(devices.mem_bw_bytes_per_s)))
    st, gr = costs.state_bytes_per_param, costs.grad_bytes_per_param
    ob = costs.optim_bytes
    sh = costs.shardable_bytes_per_param
    types = sorted(set(devices.gpu_types))
    first_cap, cap = bucket_caps(options.bucket_bytes)
    if first_cap % BUCKET_UNIT_BYTES or cap % BUCKET_UNIT_BYTES or not 0 < first_cap <= cap:
        raise ValueError(f"bucket caps ({first_cap}, {cap}) bytes must be whole KiB with 0 < first <= other "
                         f"(the CP-SAT model's bucket count relies on it)")
    fp32 = GRAD_BUCKET_BYTES_PER_PARAM
    lastb_scale = []
    for v in bw_values:  # [C-objective] sub-ns units of the last bucket's ring, per class
        per_kib, sc = 2 * gr * (BUCKET_UNIT_BYTES / fp32) / v * UNITS_PER_S, 1
        while 0 < per_kib * sc < LAST_BUCKET_RESOLUTION:
            sc *= 2
        lastb_scale.append(sc)
    lastb_scale = tuple(lastb_scale)
    xfer1 = tuple(tuple(to_units(cb / v) for cb in costs.cut_bytes_per_sample) for v in bw_values)
    return IntTables(
        num_blocks=costs.num_blocks, num_gpus=n_g, num_microbatches=m, microbatch_size=b,
        schedule=options.schedule, gpu_types=tuple(devices.gpu_types),
        work_prefix={t: _prefix(to_units(x) for x in costs.fwd_bwd_s_per_sample[t])
                     for t in sorted(set(devices.gpu_types))},
        fixed_prefix={t: _prefix(to_units(x) for x in costs.fwd_bwd_s_fixed.get(t, (0.0,) * costs.num_blocks))
                      for t in sorted(set(devices.gpu_types))},
        state_prefix=_prefix(_kib_up(st * p) for p in costs.param_count),
        act_prefix=_prefix(_kib_up(a) for a in costs.act_bytes_per_sample),
        pair_bw_class=pair_bw_class, bw_values=bw_values,
        pair_lat=pair_lat,
        xfer1=xfer1, xfer=tuple(tuple(b * x for x in row) for row in xfer1),
        gpu_node=gpu_node, pair_rows=pair_rows,
        ar_prefix=tuple(_prefix(to_units(2 * gr * p / v) for p in costs.param_count) for v in bw_values),
        grad_kib_prefix=_prefix(-(-fp32 * p // BUCKET_UNIT_BYTES) for p in costs.param_count),
        tied_grad_kib=tuple(fp32 * tp.numel // BUCKET_UNIT_BYTES for tp in costs.tied_params),
        gt_kib=tuple(_kib_up(fp32 * q) for q in costs.max_param_numel),
        tied_gt3_kib=tuple(3 * _kib_up(fp32 * tp.numel) for tp in costs.tied_params),
        bucket_caps=(first_cap // BUCKET_UNIT_BYTES, cap // BUCKET_UNIT_BYTES),
        gpu_mbw_class=tuple(mem_bw_values.index(v) for v in devices.mem_bw_bytes_per_s),
        mem_bw_values=mem_bw_values,
        opt_prefix=tuple(_prefix(to_units(2 * ob * p / v) for p in costs.param_count)
                         for v in mem_bw_values),
        cap_bytes=tuple(int(options.memory_fraction * mb) // MEMORY_UNIT_BYTES for mb in devices.memory_bytes),
        shard_prefix=_prefix(_kib_up(costs.shardable_bytes(b)) for b in range(costs.num_blocks)),
        cut_kib=tuple(_kib_up(c) for c in costs.cut_run_bytes_per_sample or costs.cut_bytes_per_sample),
        rc_work_prefix={t: _prefix(to_units(x) for x in costs.forward_s_per_sample(t)) for t in types},
        rc_fixed_prefix={t: _prefix(to_units(x) for x in costs.forward_s_fixed(t)) for t in types},
        drain_coefs=drain_coefficients(costs.forward_share_max()),
        arsh_prefix=tuple(_prefix(to_units((2 * gr * costs.param_count[b] + costs.gather_bytes(b)) / v)
                                  for b in range(costs.num_blocks)) for v in bw_values),
        opt_per_mib=tuple(to_units(2 * ob * MIB_UNITS * MEMORY_UNIT_BYTES / (sh * v)) if sh else 0
                          for v in mem_bw_values),
        tied_blocks=tuple(tuple(tp.blocks) for tp in costs.tied_params),
        tied_ar=tuple(tuple(to_units(2 * gr * tp.numel / v) for v in bw_values) for tp in costs.tied_params),
        tied_state=tuple(int(st * tp.numel) // MEMORY_UNIT_BYTES for tp in costs.tied_params),
        tied_shard=tuple(int(sh * tp.numel) // MEMORY_UNIT_BYTES for tp in costs.tied_params),
        tied_opt=tuple(tuple(to_units(2 * ob * tp.numel / v) for v in mem_bw_values) for tp in costs.tied_params),
        lastb_coef=tuple(int(round(2 * gr * (BUCKET_UNIT_BYTES / fp32) / v * UNITS_PER_S * sc))
                         for v, sc in zip(bw_values, lastb_scale)),
        lastb_scale=lastb_scale,
        sharding=options.sharding, recompute=options.recompute, grad_sharding=options.grad_sharding,
        param_sharding=options.param_sharding, offload=options.offload,
        **_host_tables(costs, devices, options),
        control_rounds=costs.step_control_rounds,
        world_lat=max((max(r) for r in pair_lat), default=0) if n_g > 1 else 0,
        world_pass=int(control_pass(_kept_array(pair_lat), np.asarray(devices.datacenter_index), range(n_g))),
        gpu_dc=devices.datacenter_index,
        step_overhead=to_units(costs.step_overhead_s),
    )


#: The (G, G) tables of the last few DeviceGraphs (``_pair_tables``), each entry
#: holding its DeviceGraph, so an entry is found by identity and never by a
#: recycled ``id``.
_PAIR_TABLES: list[tuple[DeviceGraph, tuple]] = []
_PAIR_TABLES_KEPT = 4


def _pair_tables(devices: DeviceGraph) -> tuple:
    """(pair_bw_class, bw_values, pair_lat, gpu_node, pair_rows) of ``build_tables``:
    the per-pair tables, which depend on the cluster alone. O(G^2) Python work (4,096
    GPUs: 16.8 million pairs), so computed once per DeviceGraph, not once per
    ``build_tables`` call (every micro-batch count, every ``evaluate``)."""
    for known, tables in _PAIR_TABLES:
        if known is devices:
            return tables
    n_g = devices.num_gpus
    bw = np.asarray(effective_pair_bandwidth(devices), dtype=np.float64)
    off = ~np.eye(n_g, dtype=bool)
    bw_values = tuple(float(v) for v in np.unique(bw[off])) if n_g > 1 else ()
    pair_bw_class = np.where(off, np.searchsorted(np.asarray(bw_values), bw), -1) if n_g > 1 else np.full((1, 1), -1)
    link_lat = np.asarray(devices.link_latency_s, dtype=np.float64).reshape(n_g, n_g)
    lat_s = np.maximum(link_lat, link_lat.T)
    # to_units per distinct latency (exactly as a per-pair call), then looked up
    lat_values = np.unique(lat_s)
    lat_units = np.asarray([to_units(float(v)) for v in lat_values], dtype=np.int64)
    pair_lat = np.where(off, lat_units[np.searchsorted(lat_values, lat_s)], 0)
    gpu_node, pair_rows = pair_row_codes(devices)
    tables = (tuple(map(tuple, pair_bw_class.tolist())), bw_values, tuple(map(tuple, pair_lat.tolist())),
              gpu_node, pair_rows)
    _PAIR_TABLES.insert(0, (devices, tables))
    del _PAIR_TABLES[_PAIR_TABLES_KEPT:]
    return tables


def control_pass(latency, datacenter, used):
    """[C-control]: one pass of a few bytes around the world's ring over the GPUs ``used`` (any order).

    A collective of a few bytes costs its ring's latencies, not bandwidth. The ring runs in rank order,
    node by node and datacenter by datacenter (the order of the cluster file, which the launcher
    numbers ranks in), so of its W - 1 steps per pass x = min(D, W - 1) cross between datacenters when
    the GPUs span D >= 2 of them (0 in one): each of those at the largest latency between two of the
    GPUs, the others at the largest latency between two GPUs of one datacenter::

        pass = (W - 1 - x) lat_dc + x lat_max

    (A cluster file that interleaves the nodes of its datacenters makes the ring cross more often than
    that: every example file lists a datacenter's nodes together.) In one datacenter that is (W - 1) lat_max, the lockstep ring the box measured for Gloo (bench/LOG.md
    "The step's world control collectives"); across a WAN it charges the WAN's latency per crossing, not
    per GPU (128 GPUs in two regions 50 ms apart: 2 x 50 ms + 125 x the region's latency per pass, where
    (W - 1) lat_max was 6.35 s; issue 50).

    Args:
        latency: ``(G, G)`` numpy array of link latencies (seconds, or integer units: the result is in
            the same unit and type).
        datacenter: ``(G,)`` numpy integer array, each GPU's datacenter index
            (``DeviceGraph.datacenter_index``).
        used: the GPU indices (a set, tuple, ...; duplicates ignored).

    Returns:
        The pass's latency; 0 for fewer than two GPUs.
    """
    u = np.asarray(sorted(set(used)), dtype=np.int64)
    w = len(u)
    if w < 2:
        return latency.dtype.type(0)
    sub = latency[np.ix_(u, u)]
    off = ~np.eye(w, dtype=bool)  # (the diagonal is unused)
    dcs = datacenter[u]
    lat_max = sub[off].max()
    n_dc = len(np.unique(dcs))
    if n_dc < 2:
        return (w - 1) * lat_max
    same = (dcs[:, None] == dcs[None, :]) & off
    lat_dc = sub[same].max() if same.any() else latency.dtype.type(0)
    x = min(n_dc, w - 1)
    return (w - 1 - x) * lat_dc + x * lat_max


def control_pass_s(devices: DeviceGraph, used) -> float:
    """``control_pass`` of the GPUs ``used`` on ``devices``' latencies, in seconds (0.0 for fewer than two):
    the simulator's NCCL barrier and calibration's rounds ([C-control])."""
    if len(set(used)) < 2:
        return 0.0
    return float(control_pass(np.asarray(devices.link_latency_s, dtype=float),
                              np.asarray(devices.datacenter_index, dtype=np.int64), used))


def control_units(tab: IntTables, used) -> int:
    """[C-control]: units of the step's world control collectives over the GPUs ``used`` (the plan's
    GPUs, any order): ``tab.control_rounds x`` one pass of their ring (``control_pass``: (W - 1)
    x their largest latency in one datacenter, a crossing's latency per datacenter crossed otherwise),
    plus ``tab.step_overhead``; 0 passes for one GPU. Read from the (G, G) latency table (numpy, kept
    per table as ``_pair_tables`` keeps its tables)."""
    used = tuple(used)
    w = len(used)
    if w < 2 or not tab.control_rounds:
        return tab.step_overhead
    if w == tab.num_gpus:
        one = tab.world_pass
    else:
        one = int(control_pass(_kept_array(tab.pair_lat), _kept_array(tab.gpu_dc), used))
    return tab.control_rounds * one + tab.step_overhead


#: int64 arrays of the last few tables' ``pair_lat`` / ``gpu_dc`` tuples, found by identity.
_KEPT_ARRAYS: list[tuple[tuple, np.ndarray]] = []


def _kept_array(values: tuple) -> np.ndarray:
    """``values`` (a table's ``pair_lat`` or ``gpu_dc``) as an int64 array, kept for the last few tables."""
    for known, arr in _KEPT_ARRAYS:
        if known is values:
            return arr
    arr = np.asarray(values, dtype=np.int64)
    _KEPT_ARRAYS.insert(0, (values, arr))
    del _KEPT_ARRAYS[2 * _PAIR_TABLES_KEPT:]
    return arr


def _host_tables(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> dict:
    """[C-offload]'s tables (``IntTables.host_prefix`` ...); a GPU without host memory
    (or a link or bandwidth of 0) gets host_cap 0 and off_per_mib 0."""
    per_param, n = OFFLOAD_BYTES_PER_PARAM, devices.num_gpus
    off = tuple(to_units(MIB_UNITS * MEMORY_UNIT_BYTES / per_param
                         * (OFFLOAD_LINK_BYTES / link + 2 * costs.optim_bytes / hbw)) if mem and link > 0 and hbw > 0
                else 0
                for mem, link, hbw in zip(devices.host_memory_bytes or (0,) * n, devices.host_link_bytes_per_s
                                          or (0.0,) * n, devices.host_mem_bw_bytes_per_s or (0.0,) * n))
    rep = costs.state_bytes_per_param - costs.shardable_bytes_per_param  # float32 weights and gradients
    return dict(host_prefix=_prefix(_kib_up(per_param * p) for p in costs.param_count),
                tied_host=tuple(per_param * tp.numel // MEMORY_UNIT_BYTES for tp in costs.tied_params),
                off_rep_prefix=_prefix(_kib_up(rep * p) for p in costs.param_count),
                tied_off_rep=tuple(rep * tp.numel // MEMORY_UNIT_BYTES for tp in costs.tied_params),
                host_cap=tuple(int(options.memory_fraction * mb) // MEMORY_UNIT_BYTES if o else 0
                               for mb, o in zip(devices.host_memory_bytes or (0,) * n, off)),
                off_per_mib=off,
                act_per_mib=tuple(to_units(2 * MIB_UNITS * MEMORY_UNIT_BYTES / link) if o else 0
                                  for link, o in zip(devices.host_link_bytes_per_s or (0.0,) * n, off)))
