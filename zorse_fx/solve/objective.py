"""The planners' cost model, as a pure-Python evaluator (the single source of truth).

NOTE "step-time model" -- model.py (the CP-SAT model builder of both
solve_cpsat and solve_grouped) labels its constraints with the tags below.
==========================================================================
Given S stages and M micro-batches, micro-batch size b = global_batch_size / M.

Decisions: the GPUs of each stage (each GPU in at most one stage; idle allowed
iff ``allow_idle_gpus``; every stage >= 1 GPU)                       [C-assign]
contiguous non-empty block ranges [c_s, c_{s+1}), c_0 = 0, c_S = B   [C-cuts]
integer samples n_g >= 1 per GPU of stage s, sum_{g in s} n_g = b   [C-samples]

Memory policy per stage (decisions too; ``PlanOptions.sharding`` /
``recompute`` = "never" fixes them to False, "always" to True, "auto" leaves
them to the planner; in code ``Decision.memory[s]``, a ``StageMemory``
(``ir/memory.py``): sh_s = zero >= 1, gs_s = zero >= 2, ps_s = zero == 3,
rc_s = recompute, of_s = optimizer "host", ao_s = activations "host"):
  sh_s  ZeRO-1: the stage's shardable optimizer state is split across its GPUs,
        GPU g holding z_g MiB (integers, any split covering it; only for
        stages with >= 2 GPUs)                                        [C-shard]
  rc_s  stage-level recomputation: keep only the stage's inputs per in-flight
        micro-batch, re-run the forward before each backward          [C-recompute]
  st_s  host-stashed recomputation (only where rc_s, not with gs_s nor ao_s;
        ``PlanOptions.stash``; ``StageMemory.stash`` "host", Zorse's): each
        block's inputs go to host memory in the forward, and back block by block
        in the backward, each block re-run on its own ([Note: host-stashed
        recomputation] in runtime/block_stash.py). Memory
        (``memory_policy.stash_units``): memory_g holds, per micro-batch in
        flight, n_g (X_s + X_{s+1}) (the received tensors and the outputs the
        runtime keeps; X_0 = X_S = 0), and n_g (max_b A_b + 2 max_b X_b) once
        (one block's activations, its inputs and the previous block's,
        fetched ahead), in place of [C-recompute]'s; host_g += inflight_s n_g
        I_s, I_s = the blocks' input bytes per sample (X_b, b in the stage, the
        first stage's first not counted: token ids) ([C-host-memory]). Time:
        x_g = 2 n_g I_s / host link_g (down and back), half of it beside the
        F task's compute and half beside the B task's (the runtime copies on a
        side stream), so F gains max(0, x_g / 2 - n_g Wf - Ff) and B
        max(0, x_g / 2 - its compute); not yet measured on a GPU. Not in the
        CP-SAT model                                                  [C-stash]
  gs_s  ZeRO-2 (only where sh_s; ``PlanOptions.grad_sharding``): the stage's
        float32 gradients sharded too, every micro-batch's reduce-scattered
        into the shards ([Note: sharded gradients] in runtime/grad_sync.py).
        Memory: R_s - G-_s + T_s replicated, Q_s + G+_s shardable, G+_s >=
        and G-_s <= the float32 gradient bytes of the stage's parameters less
        every tied copy another stage also holds (those keep the all-reduce),
        T_s = 6 min(G+_s, one bucket) its reduction buffers
        (``state_terms.grad_shard_kib``, ``sharded_state_kib``). Time: the
        stage's allreduce_s becomes ring(ceil(M * ar_s / 2) + ag_s) + (M nb_s
        + 1) (k - 1) lat_max: M reduce-scatters (half an all-reduce ring each)
        and the all-gather, all counted after the last backward (an upper
        bound: the runtime starts each after its own micro-batch's backward);
        L_s and optim_s as ZeRO-1's (the optimizer's z_g now also holds the
        gradient shard: its time is over-counted by that). Not in the CP-SAT
        model ([Note: ZeRO-2 outside CP-SAT] in zorse_fx/portfolio.py)
                                                                      [C-grad-shard]
  ps_s  ZeRO-3 (only where gs_s; ``PlanOptions.param_sharding``): the working
        weights sharded too, each block's gathered before its forward and
        again for its backward ([Note: sharded parameters] in
        runtime/param_shard.py). Memory: the whole replicated state of
        ZeRO-2 but its reduction buffers and the gradients of tied copies it
        all-reduces moves into the shards; the weights of GATHERED_UNITS (2)
        consecutive blocks and the stage's tied weights stay, gathered (the
        largest such sum: ``state_terms.gathered_weight_kib``). Time: per micro-batch g_s = 2 +
        rc_s gathers of the stage's weights, each a ring all-gather
        ag_s + U_s (k - 1) lat_max over its U_s = j - i blocks; the runtime
        prefetches one unit ahead, so compute_g gains max(0, g_s * G_s -
        compute_s) + g_s * ceil(G_s / U_s) (one unit per pass not hidden); the
        sync is ZeRO-2's without the all-gather after the step. Not in the
        CP-SAT model, as ZeRO-2                                      [C-param-shard]
  of_s  optimizer offload (``PlanOptions.offload``; only on GPUs whose node
        gives ``host_memory_GiB``): the stage's shardable state Q_s (AdamW
        moments; a 16-bit working weight's float32 master) leaves the GPU for
        host memory, with a float32 host copy of every other weight: H_s =
        OFFLOAD_BYTES_PER_PARAM (12) B per parameter
        (``state_terms.stage_host_kib``), all of it on each GPU's host share
        when replicated, ceil(H_s z_g / sum z) when sharded. Memory: memory_g
        loses its Q_s term, or on a sharded stage the Q_s part of its shard
        z_g: what stays is ceil(z_g MiB (N_s - Q_s) / N_s), N_s the stage's
        shardable state under its layout (ZeRO-2/3 also shard gradients and
        weights, which stay on the GPU: ``offload_device_kib``); host_g <=
        floor(memory_fraction * the GPU's share of its node's host memory)
        ([C-host-memory]). Time: optim_s becomes max_g
        host_g / MiB * off_g, off_g = (OFFLOAD_LINK_BYTES (8: the float32
        gradient down, the weight back) / host link_g + 2 optim_bytes / host
        memory bandwidth share_g) * MiB / 12 (``IntTables.off_per_mib``): the
        runtime copies, steps on the CPU and copies back in sequence, after
        the sync, nothing overlapped ([Note: optimizer offload] in
        runtime/optimizer.py). Not in the CP-SAT model      [C-offload]
  ao_s  activation offload (not with rc_s nor gs_s; ``PlanOptions.activation_offload``):
        what autograd saves for a micro-batch goes to host memory during its
        forward and back during its backward ([Note: activation offload] in
        runtime/act_offload.py). Memory: memory_g holds one micro-batch's
        n_g A_s (in place of inflight_s n_g A_s); host_g += inflight_s n_g A_s
        ([C-host-memory], with [C-offload]'s). Time: compute_g +=
        x_g = 2 n_g A_s / host link_g (down and back, not overlapped), half in
        the forward and half in the backward (``IntTables.act_per_mib``).
        Not in the CP-SAT model                                 [C-act-offload]

P_s = params of the blocks of s (a tied parameter once: [C-tied]), A_s = their activation bytes per sample,
W_{s,tau} = their fwd+bwd time per sample on GPU type tau, Q_s = their
shardable state bytes (``BlockCosts.shardable_bytes``: AdamW's moments 8 B
per float32 parameter; under a mixed precision float32 master + moments 12 B
per 16-bit working weight, whose 16-bit weight and float32 gradient stay in
R_s: [Note: 16-bit working weights] in ``precision.py``), R_s = the rest
(weights + gradients), X_s = cut bytes per sample into stage s (0 for s = 0).
  compute_g   = n_g * W_{s,type(g)} + F_{s,type(g)}                   [C-compute]
                + rc_s * (n_g * Wf_{s,type(g)} + Ff_{s,type(g)})
                (F = fixed time per micro-batch: kernel launches; Wf, Ff
                = the forward's part of W, F: ``BlockCosts.forward_s_per_sample``
                / ``forward_s_fixed``, the cost model's own split, or 1/3
                where it gives none; the recomputed forward re-runs it.
                A micro-batch's F task is n_g Wf + Ff, its B task the rest
                of compute_g)
  boundary_s  = 2 * (xfer_s + lat_s) for s < S-1, boundary_{S-1} = 0  [C-boundary]
                xfer_s = max over GPU pairs (g in s, h in s+1) of
                rows(g, h) * cut_bytes[c_{s+1}] / bw(g, h), rows = the samples
                of the micro-batch the pair's link carries at most in one
                direction: min(n_g, n_h) on one node, across nodes
                max(min(S_N, S'_N'), min(S_N', S'_N)) of the two stages'
                sample sums S, S' on the two nodes (full-duplex links), b
                across a shared link (network_terms.py [Note: boundary rows]);
                lat_s  = lat_max(s, s+1) over GPU pairs (g in s, h in s+1)
                (forward activations + backward gradients on the link that
                takes longest: on the critical path of the fill and drain;
                the steady state overlaps them, see pipe)
  t_s         = max_{g in s} compute_g + boundary_s                   [C-stage]
  allreduce_s = 0 if k = |s| = 1, else
                ceil((k - 1) / k * (2 * grad_bytes + sh_s * param_bytes) * P'_s
                / bw_min(within s)) + (2 nb_s + sh_s) * (k - 1) * lat_max(within s)
                (the gradients in nb_s buckets, each a ring all-reduce: 2 (k-1)/k
                n / bw + 2 (k-1) lat per bucket, as ``sim/network.Ring``; a
                sharded stage then all-gathers the updated weights in one
                collective: (k-1)/k n / bw + (k-1) lat. P'_s = P_s less the
                tied copies [C-tied] leaves out.
                nb_s = 1 + max(0, ceil((G_s - first_cap) / cap)), G_s = the
                float32 gradient bytes of P'_s (4 per parameter, whatever
                grad_bytes is: the buckets hold float32 master gradients), caps
                of ``ir.buckets.bucket_caps(PlanOptions.bucket_bytes)`` (1 MiB,
                then 25 MiB by default): the buckets ``sim/sync.py`` forms, cutting parameters
                at the caps (the runtime closes a bucket at the first
                parameter that reaches its cap: as many or fewer). A stage
                without any parameter of its own still counts 1 bucket (the
                simulator: none))                                     [C-allreduce]
  tied_s      = per tied parameter (``BlockCosts.tied_params``, counted in
                P of every block that reads it) whose blocks lie in stages of
                different GPU groups: its gradient all-reduced once over the
                union U of the holding stages' GPUs (in stage order), a ring:
                ceil((|U| - 1) / |U| * 2 * grad_bytes * numel / bw_min(U))
                + 2 (|U| - 1) lat_max(U); left out of every holder's own
                all-reduce; tied_s = the largest over the ones stage s holds
                (none if it holds none). Blocks in one stage (one group): reduced once
                with its gradients (P'_s leaves out all copies but one). As the
                runtime and ``sim/sync.py`` do: started with the stage's own
                reduction, each holder's optimizer waits for both.
                State and optimizer: a stage holding c >= 2 blocks of a tied
                parameter holds ONE parameter (one nn.Parameter of its
                module: one weight, gradient and AdamW state), so its P_s, R_s,
                Q_s and optimizer time count it once: the per-block sums less
                (c - 1) copies (``state_terms.py``); a tied parameter on
                several stages keeps one copy per stage. A sharded holder
                all-gathers its weights after its optimizer step, so after
                the tied ring too: its tied term is tied_s + ag_s, ag_s = the
                all-gather ring ceil(max_q (own arsh_q - own ar_q) (k - 1) / k)
                + (k - 1) lat_max (0 unsharded; overlapping it with the tied
                ring was 5.7% optimistic on Metis' zorse_paper plan,
                bench/README.md "Sharded holders of a tied parameter").  [C-tied]
  optim_s     = max_{g in s} of 2 * optim_bytes * P_s / mem_bw_g  (AdamW reads
                and writes its state once; under a mixed policy with autocast's
                weight cast of the step: cost/roofline.py [Note: the runtime's
                gradient work]), or for a sharded stage
                2 * optim_bytes * (z_g MiB / shardable_bytes) / mem_bw_g
                (each GPU updates the parameters of its shard)        [C-optim]
  pipe        = sum_s t_s + (M - 1) * T   (1F1B / GPipe fill + steady state), the period
                (network_terms.py [Note: pipeline period], the runtime's program on NCCL)
                1F1B: T = max(max_s (cmax_s + h_{s-1} + h_s), load), h_s = boundary_s / 2
                (a stage's cycle: F, a fused exchange with each neighbour, B); GPipe:
                T = max(T_F + T_B, load), T_F = max(F_0, h_0, F_s + max(h_{s-1}, h_s))
                (F_s, B_s = the stage's slowest F and B tasks, each maxed on its own),
                T_B = max(B_{S-1}, h_{S-2}, B_s + max(h_{s-1}, h_s)) (a receive is posted
                only before its compute); load = the busiest node pair's link over all
                boundaries of a micro-batch, network_terms.link_load, its busiest direction
  E_s         = sum_{j<s} (k_E cmax_j + 3 boundary_j), cmax_j = max_{g in j} compute_g;
                D_s = floor(E_s / 6) (``network_terms.drain_offsets``, which says why);
                B6_s = k_B cmax-_s (k_Brc when rc_s), cmax-_s = max_{g in s} compute_g over the blocks of s
                but its last (0 for one): 6 x a bound of the last backward after that block's
  L_s         = the last gradient bucket's ring, 0 if k = 1: max over the bw
                classes q present in s of ceil(lastb_q LK_s (k - 1) / (k
                scale_q)) + (2 + sh_s) (k - 1) lat_max(within s), + when sh_s
                the all-gather: ceil(max_q (own arsh_q - own ar_q) (k - 1) / k);
                LK_s = max(last_kib_s, untied KiB of block i_s: ``untied_block_kib``),
                last_kib_s = G_s - cap e_s + (cap - first_cap) [e_s >= 1], e_s = nb_s - 1
                (``last_bucket_kib``); lastb_q = 1/scale_q ns per KiB (``IntTables.lastb_coef``)
  step        = pipe + max_s (max(allreduce_s - floor((E_s + B6_s) / 6),
                L_s - D_s, tied_s + ag_s) + optim_s) + control  (stage 0's term is >= 0;
                a stage holding no tied_s leaves it out; a 1-GPU stage's term
                is optim_s - D_s; ``Evaluation.allreduce_s`` reports
                max(allreduce_s, tied_s)). The interleaved terms ([Note:
                interleaved stages], pipeline_terms.py) have neither the drain
                nor the own-backward offsets.                            [C-objective]
  control     = r pass(used): the step's world collectives of a few bytes each, whose time is
                their ring's latency: r = ``BlockCosts.step_control_rounds`` (3: the gradient norm's
                all-reduce, 2 passes, and the per-step table's all-gather, 1; fp16-mixed
                5: its inf/NaN agreement too); pass = (W - 1) lat_max in one datacenter, W the GPUs
                used, lat_max the largest latency between two of them; spanning D >= 2 datacenters,
                (W - 1 - x) lat_dc + x lat_max, x = min(D, W - 1) the ring's crossings, lat_dc the
                largest latency inside one datacenter (``tables.control_pass``,
                ``tables.control_units``; issue 50: 127 x 50 ms per pass on Zorse C became
                2 x 50 ms + 125 x 20 us). Added to step (the runtime runs
                them after the sync, the norm before the optimizer: step's max over the stages
                leaves that barrier out, the simulator keeps it). A constant where every GPU is used;
                with ``allow_idle_gpus`` a plan on fewer GPUs, or on one side of a WAN, pays fewer
                (measured on the box: bench/LOG.md "The step's world control collectives"); plus,
                where a calibration measured it, the loop's own overhead per step
                (``BlockCosts.step_overhead_s``, ``cost/calibration.py``; 0 otherwise)   [C-control]
  memory_g    = R_s + (sh_s ? z_g MiB : Q_s)
                + (rc_s ? n_g * (inflight_s * X_s + A_s) : inflight_s * n_g * A_s)
                + max(0, G_s - n_g * A_s)
                <= floor(memory_fraction * memory_bytes_g),
                inflight_s = min(S - s, M) for "1f1b", M for "gpipe",
                G_s a weight gradient's transient ([Note: gradient transients],
                state_terms.py)                                        [C-memory]
  coverage    sh_s => sum_{g in s} z_g MiB >= Q_s                     [C-shard]
Objective: minimise step. The planners loop over (S, M), one model per pair,
and keep the best (ties: fewer stages, then fewer micro-batches).

Integer arithmetic (shared by the evaluator, CP-SAT and brute force; tables.py):
the time unit is 1 ns (``UNITS_PER_S``). Every coefficient is rounded ONCE, to
the nearest ns, in ``build_tables``:
  * per-block, per-GPU-type time of one sample        -> prefix sums per type;
  * per-block all-reduce time 2*grad*param/bw per distinct link bandwidth (and
    per tied parameter 2*grad*numel/bw, ``tied_ar``; the ring's (k-1)/k is
    applied to the stage's integer sum, rounding up: ``ring_units``) and
    per-block optimizer time 2*state*param/mem_bw per distinct memory bandwidth
    -> prefix sums (so allreduce/optim of a stage = sum of its rounded blocks,
    less (c - 1) rounded tied copies ``tied_opt`` where [C-tied] says so);
  * per-cut transfer time of one sample cut_bytes[c]/bw per distinct link
    bandwidth (``xfer1``; a pair's rows times it; ``xfer`` = b x ``xfer1``);
  * link latencies; usable memory = floor(memory_fraction * memory_bytes).
  * bucket counts of [C-allreduce] in KiB (``BUCKET_UNIT_BYTES``): per-block
    float32 gradient KiB rounded UP -> prefix sums (``grad_kib_prefix``), per
    tied parameter rounded DOWN (``tied_grad_kib``, subtracted for the copies
    [C-tied] leaves out), the caps exact (whole KiB). G_s is then >= the exact
    bytes / 1 KiB, so nb_s is never below the runtime's count (above it only
    when a stage's rounding, < 1 KiB per block, crosses a bucket boundary).
Memory is counted in KiB (``MEMORY_UNIT_BYTES``): per-block state and
activation bytes rounded UP, usable memory rounded DOWN (conservative by at
most 1 KiB per block). With byte-sized coefficients (~4e10) OR-Tools 9.15's
presolve declared a feasible model INFEASIBLE (seen on the Metis scenario:
presolve off or KiB units give the optimum), so the tables stay small.
  * shardable state Q per block in KiB rounded up; R = (state rounded up) - Q;
    one tied copy's state and Q in KiB rounded DOWN (``tied_state``,
    ``tied_shard``), so a stage's state less its extra tied copies stays >=
    its exact bytes, and Q_s so too (the shards cover at least the exact Q_s);
    cut bytes X in KiB rounded up; a shard z_g in whole MiB (MIB_UNITS
    memory units) and its optimizer time z_g * to_units(2 * optim_bytes * MiB /
    (shardable * mem_bw)) per distinct memory bandwidth;
  * forward (and recomputation) time: per-block to_units(forward time), prefix sums;
  * (k_E, k_B, k_Brc) = ``IntTables.drain_coefs`` (4, 4, 3: the backward at twice
    the forward; lower where a block's forward is a larger share, ``tables.drain_coefficients``).
bw_min / lat_max become "max over present GPU pairs of the pair's rounded
time", which equals the formula because rounding is monotone. Every quantity
is then exact integer arithmetic, so the evaluator and the CP-SAT model agree
to the nanosecond.

[Note: shared links in the objective] and the ring / tied-parameter helpers
(``effective_pair_bandwidth``, ``ring_units``, ``tied_terms``) are in
``network_terms.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InfeasiblePlanError
from ..ir.costs import BlockCosts
from ..ir.decision import Decision
from ..ir.devices import DeviceGraph
from ..options import PlanOptions
from .network_terms import (
    boundary_rows,
    drain_offsets,
    effective_pair_bandwidth,
    last_bucket_kib,
    link_load,
    pipeline_period,
    ring_units,
    tied_terms,
    untied_block_kib,
)
# The memory policy and its terms live in memory_policy.py (re-exported: callers import them from here).
from .memory_policy import (  # noqa: F401
    MemoryPolicy,
    act_host_units,
    act_units,
    act_xfer_units,
    stash_device_kib,
    stash_inputs_kib,
    stash_units,
    balance_shards,
    fill_policy,
    inflight,
    offload_device_kib,
    sharded_state_kib,
)
from .state_terms import (offload_host_kib, offload_replicated_kib, stage_optim_units, stage_state_kib,
                          transient_kib)

# The units and integer tables live in tables.py (re-exported: callers import them from here).
from .tables import (  # noqa: F401
    BUCKET_UNIT_BYTES,
    GIB,
    GRAD_BUCKET_BYTES_PER_PARAM,
    LAST_BUCKET_RESOLUTION,
    MEMORY_UNIT_BYTES,
    MIB_UNITS,
    UNIT_S,
    UNITS_PER_S,
    IntTables,
    bucket_count,
    build_tables,
    control_units,
    to_units,
)

__all__ = [
    "UNITS_PER_S", "UNIT_S", "GIB", "fmt_bytes", "to_units", "microbatch_candidates",
    "max_stage_count", "inflight", "IntTables", "build_tables", "Evaluation",
    "evaluate", "evaluate_units", "balance_shards", "MIB_UNITS", "evaluate_result",
    "MemoryPolicy", "offload_device_kib", "prepare", "policy_decision", "act_units", "act_host_units", "act_xfer_units",
    "stash_units", "stash_inputs_kib", "stash_device_kib",
    "effective_pair_bandwidth", "ring_units", "tied_terms", "bucket_count", "GRAD_BUCKET_BYTES_PER_PARAM",
    "BUCKET_UNIT_BYTES", "drain_offsets", "LAST_BUCKET_RESOLUTION", "sharded_state_kib",
]


def fmt_bytes(nbytes: float) -> str:
    """A memory size for a message, in the largest binary unit it reaches with one
    decimal ("21.3 GiB", "512.0 MiB", "3.5 KiB", "12 B"): no size prints as "0.0 GiB"."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def microbatch_candidates(options: PlanOptions) -> tuple[int, ...]:
    """Micro-batch counts M to try (ascending): ``options.num_microbatches`` or
    every divisor of ``global_batch_size`` up to ``max_microbatches``; only
    those dividing the global batch. Raises InfeasiblePlanError if none."""
    gbs = options.global_batch_size
    if gbs < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {gbs}")
    if options.num_microbatches is not None:
        asked = sorted(set(options.num_microbatches))
        ms = tuple(m for m in asked if m >= 1 and gbs % m == 0)
        if not ms:
            raise InfeasiblePlanError(
                f"global_batch_size={gbs} cannot be divided into micro-batches: none of "
                f"num_microbatches={tuple(asked)} divides it; pick a global batch size "
                f"that one of them divides, or other micro-batch counts")
        return ms
    ms = tuple(m for m in range(1, min(gbs, options.max_microbatches) + 1) if gbs % m == 0)
    if not ms:
        raise InfeasiblePlanError(
            f"global_batch_size={gbs} cannot be divided into micro-batches: "
            f"max_microbatches={options.max_microbatches} leaves no divisor; set it >= 1")
    return ms


def max_stage_count(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> int:
    """Largest useful S: min(max_stages, blocks, GPUs)."""
    if options.max_stages < 1:
        raise ValueError(f"max_stages must be >= 1, got {options.max_stages}")
    return min(options.max_stages, costs.num_blocks, devices.num_gpus)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageUnits:
    """Integer terms of one decision (units = ns, memory in KiB units), per stage."""

    compute: tuple[int, ...]
    boundary: tuple[int, ...]
    stage: tuple[int, ...]
    allreduce: tuple[int, ...]
    optim: tuple[int, ...]
    memory: tuple[tuple[int, ...], ...]
    step: int
    #: Per stage: KiB of the shardable state no shard covers (0 = [C-shard] holds).
    uncovered: tuple[int, ...] = ()
    #: Per stage, per GPU: host KiB its offloaded optimizer holds ([C-offload]; 0: none); () = none.
    host: tuple[tuple[int, ...], ...] = ()
    #: [C-control]: the step's world control collectives (in ``step``).
    control: int = 0

    def fits(self, tab: "IntTables", stage_gpus) -> bool:
        """[C-memory], [C-shard] and [C-host-memory] hold."""
        return not any(self.uncovered) and all(
            need <= tab.cap_bytes[g] for gs, needs in zip(stage_gpus, self.memory) for g, need in zip(gs, needs)
        ) and all(h <= (tab.host_cap[g] if tab.host_cap else 0)
                  for gs, hs in zip(stage_gpus, self.host) for g, h in zip(gs, hs) if h)


def policy_decision(stage_blocks, stage_gpus, samples, num_microbatches: int, policy: MemoryPolicy,
                    interleave: int = 1) -> Decision:
    """The ``Decision`` of an integer-level candidate (what ``evaluate_units``
    scored) with the memory policy ``policy``, shards included."""
    return Decision(stage_blocks=stage_blocks, stage_gpus=stage_gpus, samples_per_microbatch=samples,
                    num_microbatches=num_microbatches, interleave=interleave, memory=policy.memory,
                    shard_mib=policy.shard_mib)


@dataclass(slots=True)
class _Terms:
    """``evaluate_units``' per-stage terms, appended stage by stage (units, KiB)."""

    comp: list = dataclasses.field(default_factory=list)  # compute_s: the slowest GPU's [C-compute]
    comp_head: list = dataclasses.field(default_factory=list)  # cmax-_s: the same without the last block
    fwd3: list = dataclasses.field(default_factory=list)  # GPipe's period terms: 3 x the forward
    bwd3: list = dataclasses.field(default_factory=list)  # and 3 x the backward
    bnd: list = dataclasses.field(default_factory=list)  # [C-boundary]
    load_rows: list = dataclasses.field(default_factory=list)  # [C-boundary] rows of each boundary's pairs
    ar: list = dataclasses.field(default_factory=list)  # [C-allreduce]
    grad_kib: list = dataclasses.field(default_factory=list)  # G_s (KiB)
    ring_lat: list = dataclasses.field(default_factory=list)  # (k - 1) * lat_max of [C-allreduce]
    gather: list = dataclasses.field(default_factory=list)  # ag_s, a sharded stage's all-gather ([C-tied])
    last: list = dataclasses.field(default_factory=list)  # L_s of [C-objective]
    opt: list = dataclasses.field(default_factory=list)
    mem: list = dataclasses.field(default_factory=list)
    unc: list = dataclasses.field(default_factory=list)
    host: list = dataclasses.field(default_factory=list)


def evaluate_units(tab: IntTables, stage_blocks, stage_gpus, samples, policy: MemoryPolicy | None = None,
                   interleave: int = 1, task_graph: bool = False, pair_cache: dict | None = None) -> StageUnits:
    """The model's integer terms for an already-validated decision (memory in KiB units).

    ``interleave`` = v > 1, or ``task_graph``: the terms of [Note: interleaved
    stages] (with v = 1: ``interleave.base_makespan_s``'s measure).
    ``pair_cache``: a dict the caller keeps across calls with this same ``tab``
    (a search moving only the cuts): each boundary's GPU-pair terms, which
    depend on the two stages' GPUs and samples and not on the cuts, are
    computed once per (GPUs, samples) pair there."""
    n_s = len(stage_blocks)
    pol = policy or MemoryPolicy.plain(n_s)
    t = _Terms()
    (excluded, tied), first_kib = tied_terms(tab, stage_blocks, stage_gpus, n_s // interleave), untied_block_kib(tab)
    for s, ((i, j), gpus, ns) in enumerate(zip(stage_blocks, stage_gpus, samples)):
        mem = pol.memory[s]
        _compute_terms(tab, t, i, j, gpus, ns, mem)
        if s < n_s - 1:
            _boundary_terms(tab, t, j, (gpus, ns), (stage_gpus[s + 1], samples[s + 1]), pair_cache)
        else:
            t.bnd.append(0)
        _sync_terms(tab, t, s, i, j, gpus, mem, excluded[s], first_kib)
        _state_terms(tab, t, s, n_s, i, j, gpus, ns, mem, pol.shard_mib[s])
    stage = tuple(c + x for c, x in zip(t.comp, t.bnd))
    control = control_units(tab, {g for gpus in stage_gpus for g in gpus})  # [C-control]
    if interleave > 1 or task_graph:
        from .pipeline_terms import interleaved_units

        p = n_s // interleave  # a GPU group's host memory holds every one of its stages' offloaded state
        host = [tuple(map(sum, zip(*t.host[s % p::p]))) for s in range(n_s)] if p else t.host
        u = interleaved_units(tab, stage_blocks, stage_gpus, samples, pol, v=interleave, comp=t.comp, bnd=t.bnd,
                              stage=stage, ar=t.ar, opt=t.opt, mem=t.mem, unc=t.unc, tied=tied,
                              buckets=(t.grad_kib, t.ring_lat), gather=t.gather)
        return dataclasses.replace(u, host=tuple(host), step=u.step + control, control=control)
    step = _pipeline_step(tab, t, stage_blocks, pol, stage, tied) + control
    ar = [a if x is None else max(a, x) for a, x in zip(t.ar, tied)]  # [C-tied]: the optimizer waits for both
    return StageUnits(compute=tuple(t.comp), boundary=tuple(t.bnd), stage=stage, allreduce=tuple(ar),
                      optim=tuple(t.opt), memory=tuple(t.mem), step=step, uncovered=tuple(t.unc),
                      host=tuple(t.host), control=control)


def _compute_terms(tab: IntTables, t: _Terms, i: int, j: int, gpus, ns, mem) -> None:
    """Stage [i, j)'s compute_s, cmax-_s and GPipe's 3 x forward / backward, with
    its recomputation and [C-act-offload]'s / [C-stash]'s transfers."""
    a = tab.act_prefix[j] - tab.act_prefix[i]
    rc, ao, st = mem.recompute, mem.activations == "host", mem.stash == "host"
    moved = stash_inputs_kib(tab, i, j) if st else a if ao else 0

    def forward(g, n, e=j):  # the forward of GPU g over blocks [i, e)
        q = tab.gpu_types[g]
        return n * (tab.rc_work_prefix[q][e] - tab.rc_work_prefix[q][i]) \
            + tab.rc_fixed_prefix[q][e] - tab.rc_fixed_prefix[q][i]

    def rerun(g, n, e):  # the recomputed forward of GPU g over blocks [i, e) (0 without recomputation)
        return forward(g, n, e) if rc else 0

    def work(g, n, e):  # [C-compute] of GPU g over blocks [i, e)
        q = tab.gpu_types[g]
        return n * (tab.work_prefix[q][e] - tab.work_prefix[q][i]) + tab.fixed_prefix[q][e] \
            - tab.fixed_prefix[q][i] + rerun(g, n, e)

    def exposed(g, n, w, f):  # (forward, backward) time the host transfers add to GPU g's F and B tasks
        x = act_xfer_units(tab, g, n, moved) if moved else 0
        if st:  # [C-stash]: on a side stream, behind the F task's compute and the B task's
            return max(0, x // 2 - f), max(0, x - x // 2 - (w - f))
        return x // 2, x - x // 2  # [C-act-offload]: on the compute stream

    fwd = [forward(g, n) for g, n in zip(gpus, ns)]
    # (compute with its re-run, the transfers' forward and backward parts)
    per_gpu = [(w, *exposed(g, n, w, f)) for g, n, f in zip(gpus, ns, fwd) for w in [work(g, n, j)]]
    t.comp.append(max(w + xf + xb for w, xf, xb in per_gpu))
    # GPipe's period: 3 x the forward (BlockCosts' forward part, the re-run table), 3 x the backward
    # = 3 x (the compute less the forward: the backward and the re-run); each with its part of the transfers.
    t.fwd3.append(max(3 * f + 3 * xf for f, (_, xf, _) in zip(fwd, per_gpu)))
    t.bwd3.append(max(3 * (w - f) + 3 * xb for f, (w, _, xb) in zip(fwd, per_gpu)))
    if ao:
        t.comp_head.append(max(work(g, n, j - 1) + act_xfer_units(tab, g, n, tab.act_prefix[j - 1] - tab.act_prefix[i])
                               for g, n in zip(gpus, ns)))  # cmax-_s
    else:  # ([C-stash]: the whole stage's exposed transfers, an upper bound)
        t.comp_head.append(max(work(g, n, j - 1) + xf + xb for (g, n), (_, xf, xb) in zip(zip(gpus, ns), per_gpu)))


def _boundary_terms(tab: IntTables, t: _Terms, j: int, here, nxt, pair_cache: dict | None) -> None:
    """[C-boundary] between the stage ending at block ``j`` and the next
    (``here`` / ``nxt``: (GPUs, samples) of each); its pair rows in ``t.load_rows``."""
    gpus, ns = here
    key = (tuple(gpus), tuple(ns), tuple(nxt[0]), tuple(nxt[1]))
    got = pair_cache.get(key) if pair_cache is not None else None
    if got is None:
        # per bandwidth class the most rows a pair of that class carries (xfer1 >= 0, so the
        # pair maximising rows x xfer1 is among them), both-ways rows, the largest latency
        rows_by_class: dict[int, int] = {}
        for (g, h), rows in boundary_rows(tab, gpus, ns, *nxt):
            q = tab.pair_bw_class[g][h]
            rows_by_class[q] = max(rows_by_class.get(q, 0), rows)
        got = (tuple(rows_by_class.items()), boundary_rows(tab, gpus, ns, *nxt, both_ways=True),
               max(tab.pair_lat[g][h] for g in gpus for h in nxt[0]))
        if pair_cache is not None:
            pair_cache[key] = got
    rows_by_class, both, lat = got
    t.load_rows.append(both)
    xfer = max(rows * tab.xfer1[q][j] for q, rows in rows_by_class)
    t.bnd.append(2 * (xfer + lat))


def _sync_terms(tab: IntTables, t: _Terms, s: int, i: int, j: int, gpus, mem, excluded: dict, first_kib) -> None:
    """Stage s's gradient sync ([C-allreduce], [C-grad-shard]), L_s and ag_s
    ([C-objective], [C-tied]), and ZeRO-3's exposed gathers ([C-param-shard])."""
    m, sh, rc = tab.num_microbatches, mem.zero >= 1, mem.recompute
    pairs = [(g, h) for a, g in enumerate(gpus) for h in gpus[a + 1:]]
    t.grad_kib.append(tab.grad_kib_prefix[j] - tab.grad_kib_prefix[i]
                      - sum(c * tab.tied_grad_kib[tp] for tp, c in excluded.items()))
    if not pairs:
        t.ring_lat.append(0)
        t.ar.append(0)
        t.last.append(0)
        t.gather.append(0)
        return

    def own(pre, q):  # the stage's sum of a per-block table less its excluded tied copies
        return pre[q][j] - pre[q][i] - sum(c * tab.tied_ar[tp][q] for tp, c in excluded.items())

    classes = {tab.pair_bw_class[g][h] for g, h in pairs}
    arb = max(own(tab.arsh_prefix if sh else tab.ar_prefix, q) for q in classes)
    t.ring_lat.append((len(gpus) - 1) * max(tab.pair_lat[g][h] for g, h in pairs))
    if mem.zero >= 2:  # [C-grad-shard]: M reduce-scatters (half an all-reduce's ring each), then the all-gather
        ag = 0 if mem.zero == 3 else 1  # [C-param-shard]: no all-gather after the step
        t.ar.append(max(ring_units(-(-m * own(tab.ar_prefix, q) // 2) + ag * (own(tab.arsh_prefix, q)
                                   - own(tab.ar_prefix, q)), len(gpus)) for q in classes)
                    + (m * bucket_count(t.grad_kib[s], tab.bucket_caps) + ag) * t.ring_lat[s])
    else:
        t.ar.append(ring_units(arb, len(gpus))
                    + (2 * bucket_count(t.grad_kib[s], tab.bucket_caps) + sh) * t.ring_lat[s])
    # [C-objective] L_s: the ring of LK_s KiB (and a sharded stage's all-gather), after the backward.
    lk, k = max(last_bucket_kib(t.grad_kib[s], tab.bucket_caps), first_kib[i]), len(gpus)
    x = max(ring_units(tab.lastb_coef[q] * lk, k, tab.lastb_scale[q]) for q in classes)
    # A sharded stage all-gathers its weights after its optimizer step: ag_s, also in L_s.
    g_ring = ring_units(max(own(tab.arsh_prefix, q) - own(tab.ar_prefix, q) for q in classes), k)
    t.gather.append(g_ring + t.ring_lat[s] if sh and mem.zero < 3 else 0)
    t.last.append(x + 2 * t.ring_lat[s] + t.gather[s])
    if mem.zero == 3:  # [C-param-shard]: g gathers of the weights per micro-batch, prefetched one unit ahead
        g, units = 2 + rc, j - i
        pass_units = g_ring + units * t.ring_lat[s]
        exposed = max(0, g * pass_units - t.comp[s]) + g * -(-pass_units // units)
        t.comp[s] += exposed
        t.comp_head[s] += exposed
        t.fwd3[s] += 3 * exposed // g
        t.bwd3[s] += 3 * exposed - 3 * exposed // g


def _state_terms(tab: IntTables, t: _Terms, s: int, n_s: int, i: int, j: int, gpus, ns, mem, z) -> None:
    """Stage s's optimizer time, memory per GPU ([C-memory], [C-shard] with the
    shards ``z`` in MiB, [C-offload], [C-act-offload]), uncovered state and host KiB."""
    rc, ao = mem.recompute, mem.activations == "host"
    a = tab.act_prefix[j] - tab.act_prefix[i]
    state, shard = stage_state_kib(tab, i, j)  # [C-tied]: a tied parameter once per stage

    def held(n):  # the activations and transients of a GPU with n samples ([Note: gradient transients])
        if mem.stash == "host":  # [C-stash]: the transients beyond what the stash and one block's activations hold
            return stash_device_kib(tab, s, n_s, i, j, n)
        return act_units(tab, s, n_s, i, n, a, recompute=rc, offload=ao) + transient_kib(tab, i, j, n, a)

    if mem.optimizer == "host":  # [C-offload]: Q_s (the shards) in host memory, the step over the host link and CPU
        if mem.zero:
            rep, need = sharded_state_kib(tab, i, j, mem.zero)
            t.unc.append(max(0, need - MIB_UNITS * sum(z)))
            dev = [offload_device_kib(zg, need, shard) for zg in z]
        else:
            z, rep, dev = None, offload_replicated_kib(tab, i, j), [0] * len(gpus)
            t.unc.append(0)
        hk = offload_host_kib(tab, i, j, z)
        hk = hk * len(gpus) if z is None else hk
        t.host.append(hk)
        t.opt.append(max(-(-h * tab.off_per_mib[g] // MIB_UNITS) for g, h in zip(gpus, hk)))
        t.mem.append(tuple(rep + d + held(n) for n, d in zip(ns, dev)))
    elif mem.zero:
        rep, shard = sharded_state_kib(tab, i, j, mem.zero)  # [C-grad-shard], [C-param-shard]
        t.opt.append(max(zg * tab.opt_per_mib[tab.gpu_mbw_class[g]] for g, zg in zip(gpus, z)))
        t.mem.append(tuple(rep + MIB_UNITS * zg + held(n) for n, zg in zip(ns, z)))
        t.unc.append(max(0, shard - MIB_UNITS * sum(z)))
        t.host.append((0,) * len(gpus))
    else:
        t.opt.append(max(stage_optim_units(tab, q, i, j) for q in {tab.gpu_mbw_class[g] for g in gpus}))
        t.mem.append(tuple(state + held(n) for n in ns))
        t.unc.append(0)
        t.host.append((0,) * len(gpus))
    if ao:  # [C-act-offload]: every micro-batch in flight in host memory
        t.host[s] = tuple(h + act_host_units(tab, s, n_s, n, a) for h, n in zip(t.host[s], ns))
    if mem.stash == "host":  # [C-stash]: every block input of every micro-batch in flight in host memory
        t.host[s] = tuple(h + stash_units(tab, s, n_s, i, j, n).host for h, n in zip(t.host[s], ns))


def _pipeline_step(tab: IntTables, t: _Terms, stage_blocks, pol: MemoryPolicy, stage, tied) -> int:
    """[C-objective]'s step without [C-control]: the stages, (M - 1) periods and the slowest sync + optimizer.

    Stage s's own sync starts during the backward of its blocks but its last (6 x an upper bound of it:
    k_B or k_Brc x cmax-_s), its last bucket only after it, D_s before the drain ends; a tied ring (held:
    not None) at the drain's end."""
    k_e, k_b, k_brc = tab.drain_coefs
    drain = drain_offsets(t.comp, t.bnd, k_e=k_e)
    drain_bwd = drain_offsets(t.comp, t.bnd, [(k_brc if mem.recompute else k_b) * c
                                              for mem, c in zip(pol.memory, t.comp_head)], k_e=k_e)
    sync = [max(a - db, lb - d) for a, db, lb, d in zip(t.ar, drain_bwd, t.last, drain)]
    # [Note: pipeline period]: 1F1B's cycle per stage is F, an exchange with each neighbour, B.
    period = pipeline_period(t.comp, t.bnd, link_load(tab, stage_blocks, t.load_rows), tab.schedule,
                             (t.fwd3, t.bwd3))
    return sum(stage) + (tab.num_microbatches - 1) * period + max(
        (w if x is None else max(w, x + ag)) + o for w, x, ag, o in zip(sync, tied, t.gather, t.opt))



@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """A decision scored by the model. Times in seconds (= integer units x 1 ns)."""

    step_time_s: float
    #: Per stage: t_s = compute + boundary; slowest GPU's compute; boundary comm.
    stage_time_s: tuple[float, ...]
    compute_s: tuple[float, ...]
    boundary_s: tuple[float, ...]
    #: Per stage: the gradient sync its optimizer waits for, max([C-allreduce], [C-tied]).
    allreduce_s: tuple[float, ...]
    optim_s: tuple[float, ...]
    #: [C-control]: the step's world control collectives (the gradient norm's all-reduce, the per-step
    #: table's all-gather; fp16-mixed: the inf/NaN agreement), in ``step_time_s``.
    control_s: float
    #: Per stage, per GPU (aligned with stage_gpus): predicted peak bytes.
    memory_bytes: tuple[tuple[int, ...], ...]
    #: Per stage, per GPU: host bytes its offloads hold ([C-offload], [C-act-offload]; 0: none).
    host_memory_bytes: tuple[tuple[int, ...], ...]
    feasible: bool
    violations: tuple[str, ...]
    #: The integer objective (ns) that CP-SAT minimises.
    objective_units: int
    #: The decision scored, each sharded stage's shards as scored
    #: (``balance_shards``' where the decision left them None).
    decision: Decision


def prepare(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
            decision: Decision) -> tuple[IntTables, MemoryPolicy]:
    """Check ``decision`` against the instance (``Decision.check``) and return
    its tables and memory policy, each sharded stage's shards filled by
    ``balance_shards`` where ``decision.shard_mib`` is None (``fill_policy``).
    Shared by ``evaluate`` and ``sim.simulate``, so both score the same shards."""
    if not isinstance(decision, Decision):
        raise TypeError(f"expected a zorse_fx.solve.Decision, got {type(decision).__name__}: build one with "
                        f"Decision(stage_blocks=..., stage_gpus=..., samples_per_microbatch=..., num_microbatches=...)")
    decision.check(num_blocks=costs.num_blocks, num_gpus=devices.num_gpus,
                   global_batch_size=options.global_batch_size, schedule=options.schedule)
    tab = build_tables(costs, devices, options, decision.num_microbatches)
    d = decision
    if d.shard_mib is None:
        return tab, fill_policy(tab, d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, memory=d.memory)
    return tab, MemoryPolicy(d.memory, d.shard_mib)


def mode_violations(options: PlanOptions, stage_gpus, pol: MemoryPolicy) -> list[str]:
    """Breaches of the memory flags (``options.sharding``, ``grad_sharding``,
    ``param_sharding``, ``offload``, ``activation_offload``, ``stash``, ``recompute``) by a
    policy, read as [Note: memory flags] in ``zorse_fx/options.py`` says: "never",
    no stage; "always", every stage (the ZeRO levels: every stage of >= 2 GPUs)."""
    bad = []
    for s, gpus in enumerate(stage_gpus):
        mem = pol.memory[s]
        flags = ((mem.zero >= 1, "sharding", "ZeRO-1 sharding", True),
                 (mem.zero >= 2, "grad_sharding", "sharded gradients (ZeRO-2)", True),
                 (mem.zero == 3, "param_sharding", "sharded parameters (ZeRO-3)", True),
                 (mem.optimizer == "host", "offload", "optimizer offload", False),
                 (mem.activations == "host", "activation_offload", "activation offload", False),
                 (mem.stash == "host", "stash", "host-stashed recomputation", False),
                 (mem.recompute, "recompute", "recomputation", False))
        for on, name, what, zero in flags:
            mode = getattr(options, name)
            if on and mode == "never":
                bad.append(f"stage {s} has {what} but {name}='never'")
            if not on and mode == "always" and (len(gpus) >= 2 or not zero):
                bad.append(f"stage {s} ({len(gpus)} GPU{'s' if len(gpus) > 1 else ''}) has no {what} but "
                           f"{name}='always'")
    return bad


def evaluate(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, decision: Decision) -> Evaluation:
    """Score ``decision`` with the model of the module note.

    ``decision.interleave`` = v > 1: S = P v stages on P GPU groups, stage s
    on the GPUs of stage s mod P, scored by [Note: interleaved stages].
    ``decision.shard_mib`` None: the shards ``balance_shards`` picks
    (``Evaluation.decision`` has them).

    Raises ValueError for a decision that does not fit the instance
    (``Decision.check``: blocks, GPU indices, samples not summing to the
    micro-batch size; a malformed decision cannot be built at all);
    constraint breaches (memory, uncovered optimizer state, idle GPUs, too
    many stages, a sharding / recompute mode not allowed by ``options``) are
    listed in ``violations``.
    """
    tab, pol = prepare(costs, devices, options, decision)
    stage_blocks, stage_gpus = decision.stage_blocks, decision.stage_gpus
    num_microbatches, interleave = decision.num_microbatches, decision.interleave
    u = evaluate_units(tab, stage_blocks, stage_gpus, decision.samples_per_microbatch, pol, interleave)
    bad = []
    if len(stage_blocks) // interleave > options.max_stages:  # GPU groups; interleaving adds chunks
        bad.append(f"{len(stage_blocks) // interleave} {'GPU groups' if interleave > 1 else 'stages'} > "
                   f"max_stages={options.max_stages}")
    allowed = (options.num_microbatches if options.num_microbatches is not None
               else range(1, options.max_microbatches + 1))
    if num_microbatches not in allowed:
        bad.append(f"num_microbatches={num_microbatches} is not among the allowed micro-batch counts")
    idle = sorted(set(range(devices.num_gpus)) - {g for gs in stage_gpus for g in gs})
    if interleave > 1 and options.max_interleave < interleave:
        bad.append(f"interleave={interleave} > max_interleave={options.max_interleave}")
    if idle and not options.allow_idle_gpus:
        bad.append(f"GPUs {idle} are idle but allow_idle_gpus=False")
    bad += mode_violations(options, stage_gpus, pol)
    for s, gpus in enumerate(stage_gpus):
        if u.uncovered[s]:
            need = sharded_state_kib(tab, *stage_blocks[s], pol.memory[s].zero)[1] * MEMORY_UNIT_BYTES
            bad.append(f"stage {s}: the shards hold {fmt_bytes(MIB_UNITS * MEMORY_UNIT_BYTES * sum(pol.shard_mib[s]))} "
                       f"of {fmt_bytes(need)} optimizer state")
        for g, h in zip(gpus, u.host[s]):
            cap = tab.host_cap[g] if tab.host_cap else 0
            if h > cap and s < len(stage_blocks) // interleave:
                node = devices.node_names[g] if devices.node_names else f"of GPU {g}"
                bad.append(f"stage {s} GPU {g} ({devices.gpu_types[g]}) offloads {fmt_bytes(h * MEMORY_UNIT_BYTES)} "
                           f"to host memory > {fmt_bytes(cap * MEMORY_UNIT_BYTES)} usable (its share of node "
                           f"{node}'s host_memory_GiB x {options.memory_fraction:g}"
                           + ("; the cluster file gives none: add host_memory_GiB to the node" if not cap else "") + ")")
        for g, need in zip(gpus, u.memory[s]):
            if need > tab.cap_bytes[g] and s < len(stage_blocks) // interleave:  # one report per GPU
                bad.append(f"stage {s} GPU {g} ({devices.gpu_types[g]}) needs {fmt_bytes(need * MEMORY_UNIT_BYTES)} > "
                           f"{fmt_bytes(tab.cap_bytes[g] * MEMORY_UNIT_BYTES)} usable ({options.memory_fraction:g} × "
                           f"{fmt_bytes(devices.memory_bytes[g])})")

    def sec(v):
        return tuple(x * UNIT_S for x in v)

    return Evaluation(step_time_s=u.step * UNIT_S, stage_time_s=sec(u.stage), compute_s=sec(u.compute),
                      boundary_s=sec(u.boundary), allreduce_s=sec(u.allreduce), optim_s=sec(u.optim),
                      control_s=u.control * UNIT_S,
                      memory_bytes=tuple(tuple(v * MEMORY_UNIT_BYTES for v in row) for row in u.memory),
                      host_memory_bytes=tuple(tuple(v * MEMORY_UNIT_BYTES for v in row) for row in u.host),
                      feasible=not bad, violations=tuple(bad),
                      objective_units=u.step,
                      decision=decision if decision.shard_mib is not None else decision.with_shards(pol.shard_mib))


def evaluate_result(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, result) -> Evaluation:
    """``evaluate`` of a SolverResult's decision, memory policy included."""
    return evaluate(costs, devices, options, result.decision)
