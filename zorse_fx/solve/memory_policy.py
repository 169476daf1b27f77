"""The memory policy of a decision, per stage (ZeRO-1/2/3 sharding, recomputation,
optimizer and activation offload), and the memory terms the planners share: the
activations a GPU holds ([C-memory], [C-act-offload]), the replicated and shardable
state of a sharded stage ([C-shard], [C-grad-shard], [C-param-shard]), the part of an
offloaded shard that stays on the GPU ([C-offload]) and the shards ``fill_policy``
chooses. The constraint tags are those of ``objective.py``'s module note, which
re-exports these names; KiB units (``tables.MEMORY_UNIT_BYTES``), times in ns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..ir.costs import extra_copies
from ..ir.memory import StageMemory
from ..options import SCHEDULES
from .state_terms import gathered_weight_kib, grad_shard_kib, stage_host_kib, stage_state_kib, transient_kib
from .tables import MIB_UNITS, IntTables

__all__ = ["inflight", "MemoryPolicy", "act_units", "act_host_units", "act_xfer_units", "StashUnits", "stash_units",
           "stash_inputs_kib", "stash_device_kib", "balance_shards",
           "sharded_state_kib", "offload_device_kib", "fill_policy", "uniform_memory"]


def inflight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at peak."""
    if schedule == "1f1b":
        return min(num_stages - stage, num_microbatches)
    if schedule == "gpipe":
        return num_microbatches
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """Per stage: its memory policy and the shard of each of its GPUs in MiB
    (aligned with the stage's GPUs; () when not sharded, [C-shard]).

    The evaluator's own view of a ``Decision``'s ``memory`` and ``shard_mib``,
    shards always chosen, used in the planners' inner loops (``evaluate_units``)
    where a validated ``Decision`` per candidate would cost more than scoring
    it; ``policy_decision`` turns a candidate and its policy into a ``Decision``."""

    #: (S,) each stage's memory policy (``ir/memory.py``).
    memory: tuple[StageMemory, ...]
    #: (S,) per sharded stage, each GPU's shard in MiB; () for an unsharded stage.
    shard_mib: tuple[tuple[int, ...], ...]

    @classmethod
    def plain(cls, num_stages: int) -> "MemoryPolicy":
        """Every stage plain (``StageMemory()``), nothing sharded."""
        return cls((StageMemory(),) * num_stages, ((),) * num_stages)


def uniform_memory(options, stage_gpus, variant: tuple[StageMemory, ...]) -> tuple[StageMemory, ...]:
    """(S,) the memory policy of each stage: the given per-stage ``variant`` (its ZeRO-1 or not and its
    recomputation; ``heuristics.memory_variants``) and what the "always" of
    ``options`` (a ``PlanOptions``) asks on top ([Note: memory flags] in
    ``zorse_fx/options.py``): ZeRO-2, and ZeRO-3 on it, on every sharded stage
    of >= 2 GPUs; optimizer offload on every stage; activation offload on
    every stage without recomputation or ZeRO-2; host-stashed recomputation on
    every recomputing stage without ZeRO-2. The baselines' uniform
    variants take them (``heuristics.Selector.add``), so a baseline's plan
    honours the flags as the stage DP's do."""
    out = []
    for gpus, v in zip(stage_gpus, variant, strict=True):
        zero, rc = int(v.zero >= 1), v.recompute
        if zero and len(gpus) >= 2 and options.grad_sharding == "always":
            zero = 3 if options.param_sharding == "always" else 2
        host_acts = options.activation_offload == "always" and not rc and zero < 2
        stash = options.stash == "always" and rc and zero < 2
        out.append(StageMemory(zero=zero, recompute=bool(rc), optimizer="host" if options.offload == "always"
                               else "device", activations="host" if host_acts else "device",
                               stash="host" if stash else "device"))
    return tuple(out)


def act_units(tab: IntTables, s: int, n_s: int, i: int, n: int, a: int, *, recompute: bool,
              offload: bool = False) -> int:
    """Activation KiB of a GPU with n samples on stage s (blocks from i, A_s = a);
    ``offload`` ([C-act-offload]): one micro-batch's on the GPU."""
    if offload:
        return n * a
    fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
    return n * (fl * (tab.cut_kib[i] if s > 0 else 0) + a) if recompute else fl * n * a


class StashUnits(NamedTuple):
    """[C-stash]'s memory of one GPU on a stage that recomputes with host-stashed block inputs, KiB
    (``stash_units``)."""

    #: Per micro-batch in flight on the device: the stage's received tensors and its outputs.
    held: int
    #: Once, in the backward: one micro-batch's largest block's activations and two of its largest block
    #: inputs (the block re-run and the one before it, fetched ahead).
    peak: int
    #: Micro-batches in flight (``inflight``).
    inflight: int
    #: In host memory: every block's inputs of every micro-batch in flight.
    host: int

    @property
    def device(self) -> int:
        """Device KiB: ``inflight`` x ``held`` + ``peak``."""
        return self.inflight * self.held + self.peak


def stash_inputs_kib(tab: IntTables, i: int, j: int) -> int:
    """[C-stash]: KiB per sample of the inputs of blocks [i, j), the cuts into them (sum of cut_k over k in
    [i, j): a value read two blocks on is counted at both cuts, an upper bound; cut_0 is empty)."""
    return sum(tab.cut_kib[i:j])


def stash_units(tab: IntTables, s: int, n_s: int, i: int, j: int, n: int) -> StashUnits:
    """[C-stash]'s memory of a GPU with n samples on stage s of n_s over blocks [i, j) (the cuts at 0 and
    B are empty, so the first stage holds no received tensor and the last sends none)."""
    fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
    cut, act = tab.cut_kib, tab.act_prefix
    peak = max(act[k + 1] - act[k] for k in range(i, j)) + 2 * max(cut[i:j])
    return StashUnits(held=n * (cut[i] + cut[j]), peak=n * peak, inflight=fl,
                      host=fl * n * stash_inputs_kib(tab, i, j))


def stash_device_kib(tab: IntTables, s: int, n_s: int, i: int, j: int, n: int) -> int:
    """[C-stash]: device KiB of a GPU with n samples on stage s over blocks [i, j) with its gradient
    transients beyond it (``state_terms.transient_kib``, [Note: gradient transients]), as every evaluator
    adds them."""
    dev = stash_units(tab, s, n_s, i, j, n).device
    return dev + transient_kib(tab, i, j, 1, dev)


def act_host_units(tab: IntTables, s: int, n_s: int, n: int, a: int) -> int:
    """[C-act-offload]: host KiB of a GPU with n samples on stage s (A_s = a): every micro-batch in flight."""
    return inflight(tab.schedule, n_s, s, tab.num_microbatches) * n * a


def act_xfer_units(tab: IntTables, g: int, n: int, a: int) -> int:
    """[C-act-offload]: units of GPU g moving n x a KiB of saved activations to host memory and back."""
    return -(-n * a * tab.act_per_mib[g] // MIB_UNITS) if tab.act_per_mib else 0


def balance_shards(need_kib: int, free_mib, rate) -> tuple[int, ...] | None:
    """Whole-MiB shards ``z_g <= free_mib[g]`` with ``MIB_UNITS * sum z >= need_kib``
    minimising ``max_g z_g * rate[g]`` (the stage's sharded optimizer time;
    ``rate`` = units per MiB). Binary search on that maximum, then surplus
    MiB are taken back from the slowest shards. None if the free memory
    cannot hold the state."""
    need = -(-need_kib // MIB_UNITS)
    free = [max(0, int(f)) for f in free_mib]
    if sum(free) < need:
        return None

    def take(limit):
        return [min(f, limit // r) if r > 0 else f for f, r in zip(free, rate)]

    lo, hi = 0, max((f * r for f, r in zip(free, rate)), default=0)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(take(mid)) >= need:
            hi = mid
        else:
            lo = mid + 1
    z = take(lo)
    surplus = sum(z) - need
    for g in sorted(range(len(z)), key=lambda g: (-z[g] * rate[g], g)):
        if surplus <= 0:
            break
        d = min(surplus, z[g])
        z[g] -= d
        surplus -= d
    return tuple(z)


def sharded_state_kib(tab: IntTables, i: int, j: int, zero: int) -> tuple[int, int]:
    """(replicated, shardable) KiB of a sharded stage (``zero`` = its ZeRO level,
    1..3) over blocks [i, j): under ZeRO-1 R_s and Q_s ([C-shard]), under ZeRO-2
    R_s - G-_s + the reduction buffers and Q_s + G+_s ([C-grad-shard],
    ``state_terms.grad_shard_kib``), under ZeRO-3 the buffers, the weights of
    GATHERED_UNITS consecutive blocks and the tied weights, and the rest
    ([C-param-shard])."""
    state, shard = stage_state_kib(tab, i, j)
    if zero < 2:
        return state - shard, shard
    up, down, transient = grad_shard_kib(tab, i, j)
    down = min(down, state - shard)  # (the replicated state holds the float32 gradients: 4 of its B/param)
    if zero == 3:  # the gradients the shards do not take (tied, all-reduced) stay whole
        grads = tab.grad_kib_prefix[j] - tab.grad_kib_prefix[i] - sum(
            c * tab.tied_grad_kib[t] for t, c in extra_copies(tab.tied_blocks, i, j))
        return transient + gathered_weight_kib(tab, i, j) + max(0, grads - up), state - grads + up
    return state - shard - down + transient, shard + up


def offload_device_kib(z_mib: int, need: int, q: int) -> int:
    """[C-offload]: KiB of an offloaded stage's shard of ``z_mib`` MiB that stay on
    the GPU: its part of the stage's shardable state ``need`` (KiB) that is not
    the optimizer's ``q`` (ZeRO-2's gradient shard, ZeRO-3's weight shard; 0
    under ZeRO-1, where need == q)."""
    return -(-z_mib * MIB_UNITS * max(0, need - q) // max(need, 1))


def fill_policy(tab: IntTables, stage_blocks, stage_gpus, samples, *, memory) -> MemoryPolicy:
    """A MemoryPolicy for the per-stage policies ``memory`` ((S,) ``StageMemory``)
    with each sharded stage's shards chosen by ``balance_shards`` on the memory
    left after the replicated state and the activations, or, offloaded
    ([C-offload]), on the host memory (when even that cannot hold the state,
    shards proportional to the free memory: ``evaluate`` then reports the breach)."""
    n_s = len(stage_blocks)
    memory = tuple(memory)
    shards = [_stage_shards(tab, s, n_s, blocks, gpus, ns, mem) if mem.zero else ()
              for s, (blocks, gpus, ns, mem) in enumerate(zip(stage_blocks, stage_gpus, samples, memory))]
    return MemoryPolicy(memory, tuple(shards))


def _stage_shards(tab: IntTables, s: int, n_s: int, blocks: tuple[int, int], gpus, samples,
                  mem: StageMemory) -> tuple[int, ...]:
    """``fill_policy``'s shards (MiB, one per GPU of ``gpus``) of sharded stage
    ``s`` of ``n_s`` over ``blocks`` = [i, j) with ``samples`` per GPU."""
    i, j = blocks
    rep, need = sharded_state_kib(tab, i, j, mem.zero)
    a = tab.act_prefix[j] - tab.act_prefix[i]
    host_acts = mem.activations == "host"

    def device_free(g, n):  # KiB of GPU g left after the replicated state, the activations and the transients
        if mem.stash == "host":  # [C-stash]
            return tab.cap_bytes[g] - rep - stash_device_kib(tab, s, n_s, i, j, n)
        return tab.cap_bytes[g] - rep - act_units(tab, s, n_s, i, n, a, recompute=mem.recompute,
                                                  offload=host_acts) - transient_kib(tab, i, j, n, a)

    def host_held(n):  # host KiB of the activations a GPU with n samples offloads or stashes
        if mem.stash == "host":
            return stash_units(tab, s, n_s, i, j, n).host
        return act_host_units(tab, s, n_s, n, a) if host_acts else 0

    if mem.optimizer == "host":  # the shards' optimizer part in host memory, H_s / N_s KiB of it per KiB of shard
        host, cap = stage_host_kib(tab, i, j), tab.host_cap or (0,) * tab.num_gpus
        q = stage_state_kib(tab, i, j)[1]
        free = []
        for g, n in zip(gpus, samples):
            f = max(0, cap[g] - host_held(n)) * need // max(host, 1)
            if need > q:  # ZeRO-2/3: the rest of the shard on the GPU
                f = min(f, max(0, device_free(g, n)) * need // (need - q))
            free.append(f // MIB_UNITS)
        z = balance_shards(need, free, [-(-tab.off_per_mib[g] * host // max(need, 1)) for g in gpus])
    else:
        free = [device_free(g, n) // MIB_UNITS for g, n in zip(gpus, samples)]
        z = balance_shards(need, free, [tab.opt_per_mib[tab.gpu_mbw_class[g]] for g in gpus])
    if z is None:
        need_mib, fr = -(-need // MIB_UNITS), [max(f, 0) for f in free]
        tot = sum(fr) or len(fr)
        z = [-(-need_mib * (f if sum(fr) else 1) // tot) for f in fr]
    return tuple(z)
