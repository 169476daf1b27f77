"""Event-driven simulator of one training step of a plan (seconds, bytes).

NOTE "simulation model" -- the planners' objective (solve/objective.py) prices
a schedule with fixed task and message times; this module replays it task by task
so that compute, boundary messages and link contention interleave as they
would on the cluster. It takes the ``Decision`` ``solve.evaluate`` takes.

Compute. GPU ``g`` of GPU group ``p`` runs the group's action list
(``ir.schedule.make_schedule(options.schedule, S, M, v)[p]``) in order,
one task at a time; an action of chunk c belongs to stage ``p + c * P``.
Without interleaving (v = 1, the default) there are P = S groups, group p is
stage p and every action is chunk 0; with ``interleave`` = v > 1 the S = P v
stages run on P groups, stage s on the GPUs of stage s mod P ([Note:
interleaved stages] in solve/pipeline_terms.py), so a GPU runs v stages, each with its
own durations, routes and held activations. For the GPU's stage s, with W =
sum over the stage's blocks of ``fwd_bwd_s_per_sample[type(g)]`` and F = sum
of ``fwd_bwd_s_fixed`` (missing type: 0), a micro-batch's forward + backward
takes ``n_g * W + F`` seconds, of which the forward (the F task) is the
cost model's own forward part (``BlockCosts.forward_s_per_sample`` /
``forward_s_fixed`` over the stage's blocks: the GPU class model and
measured profiles price the passes apart) and the backward (the B task)
the rest; where the cost model gives no split, 1/3 and 2/3 (the backward
computes the input and the weight gradient, two matmuls per forward
matmul: ``ir.costs.FORWARD_SHARE``).

Dependencies. F(s, m) on GPU j waits until the activations of every route
(i -> j) of micro-batch m from stage s-1 have *arrived*; B(s, m) waits for
F(s, m) (schedule order) and the gradients of every route (j -> k) from stage
s+1. Routes are ``ir.p2p.routes`` over the stages' row ranges (each
GPU's share laid end to end, in ``stage_gpus`` order): a route of ``rows``
samples across cut c carries ``rows * cut_bytes_per_sample[c]`` bytes, forward
when F ends on the sender, and the same bytes backward when B ends on the
receiver. Arrivals are counted per (receiving GPU, receiving stage,
micro-batch): with interleaving the same GPU pair carries the cuts of several
stages (group P-1's stage sends to group 0's next stage: the wrap-around),
and those messages are never confused.

Links. A message g -> h first waits ``link_latency_s[g][h]`` (no bandwidth
used), then transfers its bytes at a rate shared with the other messages
transferring at that moment: it uses its pair's *link resource* in its
direction (the ordered node pair for GPUs on different nodes -- one network
path per node pair --, the ordered GPU pair inside a node -- NVLink / PCIe
peer link --; full duplex: the two directions are two resources; with no
``node_names`` every GPU is its own node)
and every shared link it crosses (``DeviceGraph.shared_links``: a region's
WAN path, a node's NIC, one resource per direction), and the rates are the
max-min fair ones over all these resources, recomputed whenever a message
starts or ends its transfer ([Note: network resources] in ``sim/network.py``). Without shared links a
message uses one resource and gets ``bw / n`` of it.

[Note: point-to-point models]
When a boundary message may move is ``simulate``'s ``p2p``:
  * ``"nccl"`` (the default; what the objective prices: network_terms.py
    [Note: pipeline period], pipeline_terms.program_ends for interleaved
    plans): the runtime's own point-to-point program
    (``ir/p2p.py`` [Note: point-to-point program]; ``decision_programs``
    derives it from the decision with ``ir.p2p.programs_from``, as
    ``build_programs`` does from a plan, prefetched receives included) run
    under NCCL's rules: group k of a GPU (action k-1's sends + action k's
    receives) is posted when action k-1 ends and runs on the GPU's one
    stream after group k-1 has completed; a message starts its latency and
    transfer when the groups holding its send and its receive are both at
    the heads of their GPUs' streams (a large NCCL send needs its receive
    posted); a group completes when all its messages have arrived; action k
    starts when every group holding its receives has completed -- on NCCL the
    group is one coalesced work, so that includes action k-1's sends.
    A stage's sends are then on its critical path, paired with its
    neighbour's opposite messages (the fused exchange of
    ``torch.distributed.pipelining`` and Megatron-LM), and one GPU's messages
    never share its links with each other across groups.
  * ``"gloo"``: the same program as Gloo runs it (the runtime on CPU):
    group k is posted when action k-1 ends, every send and receive is its
    own operation (no stream order, no group completing as a whole: a
    compute waits for its receives only, a sender never waits), and a
    message is a rendezvous: the sender's data leaves when both ends have
    posted and the receiver's "ready to receive" has crossed the link, at
    max(t_send, t_recv + d), and arrives d later plus its transfer (d: the
    pair's latency). A receive posted after its send thus costs 2 d from
    its post, not d from the send: measured on the box (bench/box_p2p.py:
    16 KB across a 200 ms link, 0.403 s from the later post when the
    receive is posted at or after the send; gloo/transport/tcp/pair.cc
    sends an unbound buffer only on the peer's NOTIFY_RECV_READY).
  * ``"buffered"``: a message is posted when its task ends and the sender
    goes on at once; the receiver's task waits for its arrival (an eager
    protocol, whatever the receiver posted). What the simulator took for
    Gloo before the box measured its rendezvous.
Neither is uniformly slower: on a link-bound boundary, buffered sends
queued together share the link and arrive together
(tests/test_sim_nccl.py: 26 against NCCL's 24 time units), while NCCL's
exchange keeps a boundary off the compute's overlap. bench/README.md "The
runtime's NCCL program in the simulator" measures both on the benchmark
plans.

Memory policy (objective.py [C-shard], [C-recompute]; the decision's, as in
``solve.evaluate``: ``objective.prepare`` fills the shards of a sharded stage
with ``balance_shards`` when ``Decision.shard_mib`` is None, so both models
score the same shards).
  * Recomputation (``Decision.memory[s].recompute``): every backward of the stage first
    re-runs the forward, so a B task takes the backward + the F task's time;
    its SimEvent has ``recompute_s`` = the re-run part (0 for other tasks).
  * ZeRO-1 sharding (``Decision.memory[s].zero`` >= 1): GPU g of the stage holds ``z_g``
    whole MiB (``Decision.shard_mib[s]``) of the stage's shardable optimizer
    state Q_s = ``sum of BlockCosts.shardable_bytes`` over its blocks
    (``shardable_bytes_per_param`` per float32 parameter, 12 B per 16-bit
    working weight: [Note: 16-bit working weights] in ``precision.py``);
    see "Gradient sync". ZeRO-2 (``zero`` >= 2): the shards
    hold the float32 gradients too and the replicated state drops by them,
    plus the reduction buffers (``objective.sharded_state_kib``); each
    bucket's part of such a stage takes M reduce-scatters (half a ring
    all-reduce each) after the last backward, as the objective counts them
    ([C-grad-shard]: an upper bound, the runtime starts each after its own
    micro-batch's backward). ZeRO-3 (``zero`` == 3): the
    shards hold the weights too ([C-param-shard]); each F task gathers the
    stage's weights once and each B task once (twice when recomputing), a
    ring all-gather per block, prefetched one block ahead: a task takes
    max(its compute, its gathers) + one block's gather; no all-gather after
    the step. Activation offload (``Decision.memory[s].activations`` "host",
    [C-act-offload]): F and B each take half of 2 n A_s / host link longer;
    the GPU holds no micro-batch's activations between its F and B, one
    micro-batch's n A_s during a B.

Gradient sync, per GPU group, as the runtime does it ([Note: overlapped
gradient reduction] in ``runtime/grad_sync.py``). A group with > 1 GPU
all-reduces its gradients in buckets of ``PlanOptions.bucket_bytes`` of float32
gradients (the first 1 MiB, as DDP's), its parameters in reverse plan order (its last stage's last
block first). A bucket starts once every GPU of the group has finished, in
its stage's last backward, the bucket's earliest block -- a backward takes
its blocks in reverse order, each for its share of the stage's fwd+bwd time,
after the re-run forward on a recomputing stage -- and once the previous
bucket is done; it takes a ring all-reduce of its gradients on the group's
ring (its GPUs in stage order; ``Ring.allreduce_s`` in ``sim/network.py``):
``2 (k - 1) / k * grad_bytes * params / bw_ring + 2 * (k - 1) * lat_max``,
bw_ring the slowest hop's bandwidth, a hop's share of a shared link it
crosses counted (it does not contend with boundary messages).
So a reduction overlaps the backward of its own stage's last micro-batch
(all but the last bucket) and, as every group starts on its own, the drain
of the earlier stages; a model of one bucket per stage (all test models)
starts at the end of the last backward, as a plain all-reduce would. Then
each GPU runs its optimizer steps, its stages in order ([C-optim]):
``2 * optim_bytes * P_s / mem_bw_g``, or on a sharded stage only its
shard's parameters, ``2 * optim_bytes * (z_g MiB / shardable_bytes_per_param)
/ mem_bw_g`` (the float32 rate; for 16-bit working weights an upper bound,
as the objective's ``opt_per_mib``); an offloaded optimizer ([C-offload])
instead ``params_g (8 B / host link + 2 optim_bytes / host memory bandwidth)``,
params_g its stage's parameters or its shard's share of them, and its
shardable state out of the GPU's peak. Then the sharded stages all-gather their updated weights
("allgather" events, per GPU of the stage, one stage after the other) on the
same ring: ``(k - 1) / k * gather bytes / bw_ring + (k - 1) * lat_max``, the
gather bytes ``param_bytes`` per float32 parameter and 2 per 16-bit working weight,
starting when the group's last optimizer step ends. Without overlap (every
bucket ready at once), a stage's all-reduce + slowest optimizer + all-gather is
the objective's ``allreduce_s + optim_s`` (both price the ring with its
(k - 1)/k; the objective on the slowest pair of the stage, with shared links
through the pair bandwidth: [Note: shared links in the objective]).
The step ends when the last optimizer step /
all-gather ends. The objective starts stage s's sync D_s before the drain
ends (a lower bound of the drain after s's last backward, [C-objective];
interleaved: each of the group's buckets once the last backwards of the
stages it holds have ended) and lets the buckets overlap
that backward except its last block's, with the last bucket and the first
block's gradients after it; it counts the same buckets ([C-allreduce]'s
nb_s) but not when each block makes them ready. Times are not rounded:
where both models coincide (one stage,
GPipe with equal stages and free links, or interleaved 1F1B with equal
groups and chunks and free links) they
agree to the objective's ns rounding (<= 0.5 ns per block, and per MiB of
shard for a sharded optimizer step). Elsewhere the interleaved objective
(fixed times, no link contention) and the simulator differ
(tests/test_sim_interleaved.py, test_interleaved_agreement...).
Under ``p2p="gloo"`` (the runtime on CPU, and the box) the collectives are Gloo's: every ring step of
the gradient all-reduces and ZeRO-3's gathers pays its latency twice (a rendezvous:
``ring(..., rendezvous=True)``), and two buckets reduce at once, their latencies overlapped and their
transfers in turn (``sync._reduction``'s ``in_flight``); measured on the box (bench/LOG.md "The
box's WAN: TCP windows and Gloo's rendezvous"); ZeRO-1's all-gather of unequal shards is one
binomial-tree broadcast per shard (``runtime/param_shard.py``; ``network.gloo_unequal_allgather_s``),
not a ring. ZeRO-3's gathers are
such broadcasts on Gloo too, but priced as (rendezvous) ring all-gathers: not yet measured on the box.
The world's small collectives (the control all-reduces, the per-step record all-gather) and a tied
parameter's all-reduce are replayed operation by operation under Gloo, each rank leaving when its own
part ends ([Note: Gloo's collectives as programs] in sim/gloo.py), so the ranks end a step at different
times; Gloo's transport (its in-band ready, TCP's pacing) is in that module's notes.

[Note: the steady state under Gloo]
A training step starts on each rank where that rank's part of the previous step's record all-gather
ended. Under Gloo those ends differ by up to a WAN latency (box case b_wan_shared: rank 2 0.2 s after
rank 0, rank 3 0.2 s before it, every step of every plan), and a stage on a late rank starts its
micro-batches late, or a late receiver delays a rendezvous (bench/LOG.md, "Gloo's small collectives,
rank by rank"). So under ``p2p="gloo"``, where the step ends with the world's record all-gather
(``BlockCosts.step_control_rounds`` > 0; costs built by hand for the pipeline alone have none and
keep one step from a common start), ``simulate`` replays the step from the starts the previous
replay ended at (``_Pipeline``'s ``start``: a GPU posts its first receives and runs its first action no
earlier; offsets from the earliest rank), until they repeat (within 1e-9 of the step) or
``STEADY_STATE_STEPS`` replays; ``step_time_s`` is the last replay's longest start-to-end, the
period of the steady state, and its events are that replay's (times from the earliest rank's start).
The objective and ``p2p="nccl"`` keep one step from a common start (their collectives end together).

Tied parameters (``BlockCosts.tied_params``: a tied input / output embedding
read by the first and the last block). As the runtime does ([Note:
overlapped gradient reduction]), a tied parameter whose blocks fall on stages
of different GPU groups is left out of those groups' buckets and all-reduced
once over the union of the holding stages' GPUs ("tiedreduce" events, per
GPU of the union): a ring over the union in stage order,
``Ring.allreduce_s(grad_bytes * numel)``, starting when every holder's copy
is final (the last backward of each holding stage has passed the block that
reads it), not contending with the groups' own buckets (under ``p2p="gloo"``
gloo's ring in rank order replayed from each holder's own entry, paced: sim/gloo.py); each holder's
optimizer steps wait for it. When one group holds every copy, its buckets
reduce the parameter once. A stage holding several of its blocks updates
it once: its optimizer step and all-gather move the stage's parameters with
the tied one counted once (as its state in "Memory"). The objective prices both the same way ([C-tied]
in solve/objective.py: the ring over the union, on its slowest pair, from the
drain on, max'ed with the stage's own reduction before the optimizer).

Memory. Counted in the objective's memory units (``MEMORY_UNIT_BYTES`` = 1
KiB; per-block state, shardable state, activation and cut bytes rounded UP,
``build_tables``) and reported in bytes (units x 1024), so a peak can be
compared with ``Evaluation.memory_bytes`` exactly. Peak per GPU = state +
the largest activation footprint tracked through the simulation, both summed
over the GPU's stages (one without interleaving):
  state       = state_bytes * P_s, or on a sharded stage the replicated rest
                (state - Q_s) + z_g MiB (P_s, Q_s count a tied parameter
                once per stage, as the stage module holds one
                nn.Parameter: objective.py [C-tied]; a copy rounded DOWN to
                KiB, as ``build_tables``);
  activations = sum over its stages of live_s * held_s, live_s = micro-batches
                whose stage-s forward has ended and whose backward has not,
                held_s = n_g * A_s, or on a recomputing stage n_g * X_s, plus
                n_g * A_s of the stage whose backward runs on a recomputing
                stage (X_s = cut bytes per sample into the stage, 0 for stage
                0; the re-run forward's full activations live until its
                backward ends; the recomputing micro-batch stays counted in
                the first term too).
For 1F1B / GPipe the tracked count peaks at the objective's inflight_s
(min(S - s, M) / M), and a recomputing stage's first backward starts with
that many inputs held, so the peaks EQUAL ``evaluate``'s [C-memory]; with
interleaving the footprint is tracked at the moments of
``schedule.live_profile``, where the objective takes its maximum, so the peaks
equal ``evaluate``'s [Note: interleaved stages] memory too.
Transient memory (a forward's working set, the gradient buffers of the
all-reduce, the all-gather's receive buffer) is not modelled, as in the
objective.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from ..ir.costs import BlockCosts, unique_params
from ..ir.decision import Decision
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.p2p import RankProgram, programs_from, route_messages, routes
from ..ir.schedule import make_schedule
from ..options import PlanOptions
from ..solve.objective import (MEMORY_UNIT_BYTES, MIB_UNITS, offload_device_kib, prepare, sharded_state_kib,
                               stash_inputs_kib, stash_units)
from ..solve.state_terms import offload_replicated_kib, stage_state_kib, transient_kib
from .gloo import paced_transfer_s
from .network import FlowResources, link_resource, max_min_rates, ring
from .sync import gradient_sync

__all__ = ["SimEvent", "SimResult", "simulate", "link_resource", "decision_programs",
           "P2P_BUFFERED", "P2P_NCCL", "P2P_GLOO"]

#: ``simulate(p2p=...)``: boundary messages sent as the runtime's
#: point-to-point program runs under NCCL (the default) or as Gloo buffers
#: them (a send leaves when its task ends; the sender goes on) ([Note:
#: point-to-point models]).
P2P_BUFFERED = "buffered"
P2P_NCCL = "nccl"
#: ... or as Gloo runs the program: each send and receive its own operation, a
#: send's data leaving once the receiver has posted the receive and said so
#: (a rendezvous), measured on the box (bench/box_p2p.py).
P2P_GLOO = "gloo"
P2P_MODES = (P2P_NCCL, P2P_GLOO, P2P_BUFFERED)

KINDS = ("F", "B", "send", "allreduce", "tiedreduce", "control", "optim", "allgather")


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One interval of the simulated step.

    ``kind``: "F" / "B" (compute of ``microbatch`` on ``gpu``), "send" (a
    boundary message from ``gpu`` to ``peer``, ``start_s`` = when the sender
    finished its task, ``end_s`` = arrival, ``nbytes`` bytes; forward
    activations go to stage+1, gradients to stage-1), "allreduce" (per GPU of
    the stage, ``nbytes`` = gradient bytes), "optim" (``nbytes`` = state bytes
    read and written; on a sharded stage those of the GPU's shard),
    "allgather" (per GPU of a sharded stage, ``nbytes`` = weight bytes of the
    stage), "tiedreduce" (per GPU holding a tied parameter whose holders span
    several GPU groups, ``nbytes`` = its gradient bytes; ``stage`` = the last
    holding stage). ``microbatch`` is -1 for "allreduce", "tiedreduce",
    "optim" and "allgather".
    ``stage``: the stage the task belongs to (with interleaving a GPU runs
    several), for "send" the sender's; ``peer_stage``: for "send" the
    receiving stage (``stage + 1`` for activations, ``stage - 1`` for
    gradients), None otherwise.
    ``recompute_s``: for a "B" task of a recomputing stage, the seconds spent
    re-running the forward at its start (0 otherwise).
    Times in seconds from the start of the step."""

    kind: str
    gpu: int
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    peer: int | None = None
    nbytes: int = 0
    recompute_s: float = 0.0
    peer_stage: int | None = None


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`. Per-GPU tuples are indexed like the DeviceGraph."""

    step_time_s: float
    #: F+B compute seconds / step time (0 for idle GPUs).
    busy_fraction: tuple[float, ...]
    #: Peak bytes (training state + activations in flight, counted in the
    #: objective's KiB units: see the module note); 0 for idle GPUs.
    peak_memory_bytes: tuple[int, ...]
    events: tuple[SimEvent, ...]
    #: 1 - mean busy_fraction over the GPUs the plan uses.
    bubble_fraction: float
    #: Node name and GPU type per GPU (for traces and charts).
    gpu_nodes: tuple[str, ...] = ()
    gpu_types: tuple[str, ...] = ()
    #: The memory policy simulated (as ``Evaluation.decision``): (S,) each stage's
    #: ``StageMemory`` (``ir/memory.py``), and each GPU's shard in bytes (aligned
    #: with stage_gpus; 0 when not sharded).
    memory: tuple[StageMemory, ...] = ()
    state_shard_bytes: tuple[tuple[int, ...], ...] = ()
    #: Interleave degree v simulated: S = P v stages on P GPU groups, stage s
    #: on group s mod P (a GPU's events carry the stage they ran).
    interleave: int = 1
    #: Per GPU, seconds: when its step starts, from the earliest rank's start (all 0 but in Gloo's steady
    #: state, [Note: the steady state under Gloo]); its step ends ``step_time_s`` later.
    start_s: tuple[float, ...] = ()


class _Msg:
    # res: the resources the message uses, ((key, capacity), ...): its pair's link first, then
    # the shared links it crosses ([Note: network resources] in sim/network.py)
    # key: the program's Message under P2P_NCCL (None when sends are buffered)
    __slots__ = ("src", "dst", "stage", "m", "fwd", "nbytes", "t0", "ready", "left", "bw", "res", "rate", "key")

    def __init__(self, src, dst, stage, m, fwd, nbytes, t0, ready, bw, res, key=None):
        self.src, self.dst, self.stage, self.m, self.fwd = src, dst, stage, m, fwd
        self.nbytes, self.t0, self.ready, self.bw, self.res = nbytes, t0, ready, bw, res
        self.key = key
        self.left, self.rate = float(nbytes), 0.0


def _ranges(ns) -> tuple[tuple[int, int], ...]:
    out, a = [], 0
    for n in ns:
        out.append((a, a + n))
        a += n
    return tuple(out)


def decision_programs(costs: BlockCosts, decision: Decision, schedule: str) -> dict[int, RankProgram]:
    """The runtime's point-to-point program (``ir.p2p.programs_from``, as
    ``build_programs`` derives it from a plan) of ``decision`` under
    ``schedule``, keyed by GPU index (the ranks of the plan, in the cluster's
    numbering); message bytes are ``rows * cut_bytes_per_sample`` of the cut.

    Raises:
        ir.p2p.ProgramError: the program would deadlock under NCCL's rules."""
    n_s, v = decision.num_stages, decision.interleave
    n_p = n_s // v
    sched = make_schedule(schedule, n_s, decision.num_microbatches, v)
    ranges = [_ranges(ns) for ns in decision.samples_per_microbatch]
    row_bytes = [costs.cut_bytes_per_sample[decision.stage_blocks[s][1]] for s in range(n_s - 1)]
    built = {}
    for p in range(n_p):
        for g in decision.stage_gpus[p]:
            built[g] = (sched[p], [route_messages(a, p + a.chunk * n_p, decision.stage_gpus[p + a.chunk * n_p].index(g),
                                                  g, decision.stage_gpus, ranges, row_bytes) for a in sched[p]])
    return programs_from(built)


class _Pipeline:
    """The pipeline part of one simulated step (``simulate``): every GPU runs its
    group's schedule, an action starts when its inputs arrived, boundary messages
    move over max-min fair links. ``run()`` replays it; afterwards ``events``,
    ``busy``, ``peak_act``, ``last_b`` and ``last_b_span`` hold the outcome."""

    def __init__(self, costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, decision: Decision,
                 tab, pol, p2p: str, start: dict[int, float] | None = None):
        self.costs, self.devices, self.decision, self.pol = costs, devices, decision, pol
        #: Per GPU when its step starts (seconds; absent: 0): its first receives are posted and its first
        #: action may run no earlier ([Note: the steady state under Gloo]).
        self.start = dict(start or {})
        self.n_s, self.v = decision.num_stages, decision.interleave
        self.n_p = self.n_s // self.v  # GPU groups; stage s runs on group s % n_p as its chunk s // n_p
        self.sched = make_schedule(options.schedule, self.n_s, decision.num_microbatches, self.v)
        self.resources = FlowResources(devices)
        self.gloo = p2p == P2P_GLOO  # (its collectives are rendezvous rings: ``ring``'s ``rendezvous``)
        self._stage_work(tab)
        self._routes()
        self.used = sorted(self.group_of)
        used = self.used
        self.acts = {g: self.sched[self.group_of[g]] for g in used}
        self.pc = {g: 0 for g in used}
        self.running: dict[int, tuple[float, float, str, int, int]] = {}  # g -> (start, end, kind, m, stage)
        # Messages arrived, keyed by (receiver GPU, receiver stage, micro-batch).
        self.got_fwd: dict[tuple[int, int, int], int] = defaultdict(int)
        self.got_bwd: dict[tuple[int, int, int], int] = defaultdict(int)
        self.live = {g: [0] * self.v for g in used}  # per chunk: forwards ended, backward not
        self.peak_act = {g: 0 for g in used}
        self.busy = {g: 0.0 for g in used}
        self.last_b = {}
        self.last_b_span: dict[tuple[int, int], tuple[float, float]] = {}  # (GPU, stage) -> its last backward
        self.events: list[SimEvent] = []
        self.waiting: list[_Msg] = []  # in their latency phase
        self.active: list[_Msg] = []  # transferring
        # P2P_GLOO: messages whose receiver's ready waits behind data on the reverse connection
        # ([Note: Gloo's ready behind data]): (message, its reverse messages still to arrive, earliest ready)
        self.blocked: list[tuple[_Msg, list[_Msg], float]] = []
        self.t = 0.0
        # P2P_NCCL ([Note: point-to-point models]): each rank's groups in order on its stream;
        # P2P_GLOO: the same groups, each operation on its own, every message a rendezvous.
        self.nccl = p2p == P2P_NCCL
        self.program = self.nccl or self.gloo
        if self.program:
            self.progs = progs = decision_programs(costs, decision, options.schedule)
            self.where = {(op.send, op.message): (g, gi) for g, pr in progs.items()
                          for gi, grp in enumerate(pr.groups) for op in grp}
            # Per group the messages not yet arrived: all of them under NCCL (a group completes as a whole),
            # the receives alone under Gloo (a compute waits for the groups holding its receives).
            self.remaining = {(g, gi): sum(1 for op in grp if self.nccl or not op.send) for g, pr in progs.items()
                              for gi, grp in enumerate(pr.groups)}
            self.stream = {g: deque() for g in used}
            self.posted = dict.fromkeys(used, 0)
            self.post_time: dict[tuple[int, int], float] = {}
            self.finished: set[tuple[int, int]] = set()
            self.started: set = set()
            for g in used:
                self._post_group(g)  # G_0: the receives of the first action

    def _stage_work(self, tab) -> None:
        """Per GPU its group; per (GPU, stage) the F / B seconds and the re-run part of B;
        the activation footprint per GPU and chunk, in memory units: per micro-batch held
        (n A_s, or n X_s when recomputing) and, when recomputing, the re-run forward's n A_s."""
        costs, devices, pol, n_p, d = self.costs, self.devices, self.pol, self.n_p, self.decision
        self.group_of, self.dur, self.rc_dur = {}, {}, {}
        self.held: dict[int, list[int]] = defaultdict(lambda: [0] * self.v)
        self.rerun: dict[int, list[int]] = defaultdict(lambda: [0] * self.v)
        for s, ((i, j), gpus, ns) in enumerate(zip(d.stage_blocks, d.stage_gpus, d.samples_per_microbatch)):
            a_kib = tab.act_prefix[j] - tab.act_prefix[i]
            for g, n in zip(gpus, ns):
                t = devices.gpu_types[g]
                w = sum(costs.fwd_bwd_s_per_sample[t][i:j])
                f = sum(costs.fixed_s(t)[i:j])
                fwd = n * sum(costs.forward_s_per_sample(t)[i:j]) + sum(costs.forward_s_fixed(t)[i:j])
                self.group_of[g] = s % n_p
                self.rc_dur[g, s] = fwd if pol.memory[s].recompute else 0.0
                self.dur[g, s] = (fwd, max(0.0, n * w + f - fwd) + self.rc_dur[g, s])
                if pol.memory[s].zero == 3:  # ZeRO-3: the weights' gathers, prefetched one unit ahead ([C-param-shard])
                    units = j - i
                    moved = (sum(costs.gather_bytes(b) for b in range(i, j))  # a tied parameter once ([C-tied])
                             - costs.param_bytes_per_param * (sum(costs.param_count[i:j]) - unique_params(costs, i, j)))
                    per_pass = units * ring(devices, gpus, self.resources, rendezvous=self.gloo).allgather_s(
                        moved / units)
                    fwd, bwd = self.dur[g, s]
                    k_b = 2 if pol.memory[s].recompute else 1  # a recomputing B gathers for its re-run forward too
                    self.dur[g, s] = (fwd + max(0.0, per_pass - fwd) + per_pass / units,
                                      bwd + max(0.0, k_b * per_pass - bwd) + k_b * per_pass / units)
                if pol.memory[s].activations == "host":  # [C-act-offload]: saved tensors down in F, back in B
                    # (half each); one on the GPU
                    x = 2 * n * a_kib * MEMORY_UNIT_BYTES / devices.host_link_bytes_per_s[g]
                    fwd, bwd = self.dur[g, s]
                    self.dur[g, s] = (fwd + x / 2, bwd + x / 2)
                    self.held[g][s // n_p], self.rerun[g][s // n_p] = 0, n * a_kib
                elif pol.memory[s].stash == "host":  # [C-stash]: block inputs down in F, back in B (half each),
                    # on a side stream behind the task's compute; held: the received and sent tensors; B: one
                    # block re-run, its inputs and the next's
                    st = stash_units(tab, s, self.n_s, i, j, n)
                    x = 2 * n * stash_inputs_kib(tab, i, j) * MEMORY_UNIT_BYTES / devices.host_link_bytes_per_s[g]
                    fwd, bwd = self.dur[g, s]
                    self.dur[g, s] = (max(fwd, x / 2), max(bwd, x / 2))
                    self.held[g][s // n_p], self.rerun[g][s // n_p] = st.held, st.peak
                elif pol.memory[s].recompute:
                    self.held[g][s // n_p], self.rerun[g][s // n_p] = n * (tab.cut_kib[i] if s > 0 else 0), n * a_kib
                else:
                    self.held[g][s // n_p] = n * a_kib

    def _routes(self) -> None:
        """Routes across the cut after stage s, keyed by (sender GPU, sender stage):
        out_fwd[g, s] = [(dst, bytes)]; need_fwd[h, s] = messages (h, s) waits for per micro-batch."""
        d, costs = self.decision, self.costs
        self.out_fwd: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        self.out_bwd: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        self.need_fwd: dict[tuple[int, int], int] = defaultdict(int)
        self.need_bwd: dict[tuple[int, int], int] = defaultdict(int)
        for s in range(self.n_s - 1):
            cut_b = costs.cut_bytes_per_sample[d.stage_blocks[s][1]]
            src, dst = d.stage_gpus[s], d.stage_gpus[s + 1]
            for r in routes(_ranges(d.samples_per_microbatch[s]), _ranges(d.samples_per_microbatch[s + 1])):
                g, h = src[r.src_pos], dst[r.dst_pos]
                self.out_fwd[g, s].append((h, r.rows * cut_b))
                self.out_bwd[h, s + 1].append((g, r.rows * cut_b))
                self.need_fwd[h, s + 1] += 1
                self.need_bwd[g, s] += 1

    def _footprint(self, g) -> int:
        return sum(c * h for c, h in zip(self.live[g], self.held[g]))

    def _post(self, src, dst, s, m, fwd, nbytes, key=None, t0=None, recv_t=None):
        """Start a message: its latency phase ends d after now, or (``recv_t``: P2P_GLOO's
        rendezvous, the receive's post time; ``t0``: the send's, default now) at
        max(t0, recv_t + d) + d."""
        devices = self.devices
        lat = max(devices.link_latency_s[src][dst], 0.0)
        sent = self.t if t0 is None else max(self.t, t0)
        ready = self.t + lat if recv_t is None else max(sent, recv_t + lat) + lat
        bw = devices.link_bw_bytes_per_s[src][dst]
        if not bw > 0:
            raise ValueError(f"link bandwidth from GPU {src} to {dst} must be > 0, got {bw}")
        if self.gloo and nbytes > 0:  # [Note: TCP pacing of a message] in sim/gloo.py
            back = max(devices.link_latency_s[dst][src], 0.0)
            # A send that waited for its ready and leaves within a round trip of its post: gloo's
            # NOTIFY_SEND_READY still unacknowledged, its connection's window grown further.
            notified = recv_t is not None and sent < recv_t + back < sent + lat + back
            bw = nbytes / paced_transfer_s(nbytes, bw, lat + back, notified=notified)
        res = ((link_resource(devices, src, dst), bw), *self.resources.shared(src, dst))
        msg = _Msg(src, dst, s, m, fwd, nbytes, self.t if t0 is None else t0, ready, bw, res, key)
        if self.gloo and recv_t is not None:  # [Note: Gloo's ready behind data] in sim/gloo.py
            back = max(devices.link_latency_s[dst][src], 0.0)
            ahead = [x for x in self.waiting + self.active
                     if (x.src, x.dst) == (dst, src) and x.ready - back <= recv_t]  # its data left before
            if ahead:
                self.blocked.append((msg, ahead, sent))
                return
        self.waiting.append(msg)

    def _unblock(self, arrived: _Msg) -> None:
        """P2P_GLOO: ``arrived`` came in at ``self.t``; a message whose receiver's ready was queued behind it
        (and behind nothing else) now leaves: its ready reached the sender with this data's last byte."""
        keep = []
        for msg, ahead, sent in self.blocked:
            if arrived in ahead:
                ahead.remove(arrived)
                if not ahead:
                    lat = max(self.devices.link_latency_s[msg.src][msg.dst], 0.0)
                    msg.ready = max(msg.ready, max(sent, self.t) + lat)
                    self.waiting.append(msg)
                    continue
            keep.append((msg, ahead, sent))
        self.blocked = keep

    def _arrive(self, msg: _Msg, when: float):
        if self.blocked:
            self._unblock(msg)
        self.events.append(SimEvent("send", msg.src, msg.stage, msg.m, msg.t0, when, msg.dst, msg.nbytes,
                                    peer_stage=msg.stage + (1 if msg.fwd else -1)))
        if self.nccl:
            for side in (True, False):
                self.remaining[self.where[side, msg.key]] -= 1
            self._advance(msg.src)
            self._advance(msg.dst)
        elif self.gloo:
            self.remaining[self.where[False, msg.key]] -= 1
        elif msg.fwd:
            self.got_fwd[msg.dst, msg.stage + 1, msg.m] += 1
        else:
            self.got_bwd[msg.dst, msg.stage - 1, msg.m] += 1

    def _head(self, g):
        return self.stream[g][0] if self.stream[g] else None

    def _advance(self, g):
        """Retire g's finished head groups; start every message whose two groups are both at the head."""
        while (h := self._head(g)) is not None:
            if self.remaining[g, h] == 0:
                self.stream[g].popleft()
                self.finished.add((g, h))
                continue
            for op in self.progs[g].groups[h]:
                msg = op.message
                if msg in self.started:
                    continue
                peer, pg = self.where[not op.send, msg]
                if self._head(peer) == pg:
                    self.started.add(msg)
                    fwd = not msg.backward
                    self._post(msg.src, msg.dst, msg.boundary if fwd else msg.boundary + 1, msg.microbatch, fwd,
                               msg.nbytes, key=msg, t0=self.post_time[self.where[True, msg]])
            return

    def _post_group(self, g):
        gi = self.posted[g]
        self.posted[g] += 1
        self.post_time[g, gi] = max(self.t, self.start.get(g, 0.0))
        if self.gloo:  # every message whose other end is posted too starts now, the later end posting
            for op in self.progs[g].groups[gi]:
                send, recv = ((g, gi), self.where[False, op.message]) if op.send else \
                    (self.where[True, op.message], (g, gi))
                if send in self.post_time and recv in self.post_time:
                    msg = op.message
                    fwd = not msg.backward
                    self._post(msg.src, msg.dst, msg.boundary if fwd else msg.boundary + 1, msg.microbatch, fwd,
                               msg.nbytes, key=msg, t0=self.post_time[send], recv_t=self.post_time[recv])
            return
        self.stream[g].append(gi)
        self._advance(g)

    def _ready(self, g) -> bool:
        if self.t < self.start.get(g, 0.0):
            return False
        if self.nccl:
            return all((g, gi) in self.finished for gi in self.progs[g].waits[self.pc[g]])
        if self.gloo:
            return all(self.remaining[g, gi] == 0 for gi in self.progs[g].waits[self.pc[g]])
        a = self.acts[g][self.pc[g]]
        s = self.group_of[g] + a.chunk * self.n_p
        if a.kind == "F":
            return self.got_fwd[g, s, a.microbatch] >= self.need_fwd[g, s]
        return self.got_bwd[g, s, a.microbatch] >= self.need_bwd[g, s]

    def run(self) -> None:
        """Replay the step until no task runs and no message is in flight.

        Raises:
            RuntimeError: a GPU is left waiting (the schedule or program deadlocked)."""
        while True:
            self._start_ready_actions()
            finish = {id(x): self.t + x.left / x.rate for x in self.active}
            cands = [r[1] for r in self.running.values()] + [x.ready for x in self.waiting] + list(finish.values())
            cands += [t for g, t in self.start.items() if t > self.t and g not in self.running
                      and self.pc[g] < len(self.acts[g])]  # a GPU whose step has not started yet
            if not cands:
                break
            t_next = max(min(cands), self.t)
            for x in self.active:
                x.left -= x.rate * (t_next - self.t)
            self.t = t_next
            tol = 1e-12 * max(1.0, self.t)
            self._end_actions(tol)
            self._move_messages(finish, tol)
        stuck = [g for g in self.used if self.pc[g] < len(self.acts[g]) or (self.nccl and self.stream[g])
                 or (self.gloo and any(self.remaining[g, gi] for gi in range(len(self.progs[g].groups))))]
        if stuck:
            at = [str(self.acts[g][self.pc[g]]) if self.pc[g] < len(self.acts[g]) else "its last sends" for g in stuck]
            raise RuntimeError(f"schedule deadlocked: GPUs {stuck} wait at actions {at}")

    def _start_ready_actions(self) -> None:
        for g in self.used:
            if g not in self.running and self.pc[g] < len(self.acts[g]) and self._ready(g):
                a = self.acts[g][self.pc[g]]
                s = self.group_of[g] + a.chunk * self.n_p
                self.running[g] = (self.t, self.t + self.dur[g, s][a.kind == "B"], a.kind, a.microbatch, s)
                if a.kind == "B":  # the recomputed micro-batch is still held, plus its full activations
                    self.peak_act[g] = max(self.peak_act[g], self._footprint(g) + self.rerun[g][a.chunk])

    def _end_actions(self, tol: float) -> None:
        t, n_p = self.t, self.n_p
        for g in sorted(self.running):
            start, end, kind, m, s = self.running[g]
            if end > t + tol:
                continue
            del self.running[g]
            self.pc[g] += 1
            self.events.append(SimEvent(kind, g, s, m, start, t, recompute_s=self.rc_dur[g, s] if kind == "B" else 0.0))
            self.busy[g] += t - start
            if kind == "F":
                self.live[g][s // n_p] += 1
                self.peak_act[g] = max(self.peak_act[g], self._footprint(g))
                for h, nb in () if self.program else self.out_fwd[g, s]:
                    self._post(g, h, s, m, True, nb)
            else:
                self.live[g][s // n_p] -= 1
                self.last_b[g] = t
                self.last_b_span[g, s] = (start, t)
                for h, nb in () if self.program else self.out_bwd[g, s]:
                    self._post(g, h, s, m, False, nb)
            if self.program:
                self._post_group(g)  # G_{k+1}: this action's sends + the next action's receives

    def _move_messages(self, finish: dict, tol: float) -> None:
        """Deliver the messages that arrived, start those whose latency passed, and share
        the links among the transferring ones (max-min fair over every resource; a pair
        link's capacity: its smallest figure)."""
        t, active = self.t, self.active
        n_active = len(active)
        for x in [x for x in active if finish[id(x)] <= t + tol]:
            active.remove(x)
            self._arrive(x, t)
        changed = len(active) != n_active
        for x in [x for x in self.waiting if x.ready <= t + tol]:
            self.waiting.remove(x)
            if x.nbytes <= 0 or math.isinf(x.bw):
                self._arrive(x, t)
            else:
                active.append(x)
                changed = True
        if changed and active:
            cap: dict[tuple, float] = {}
            for x in active:
                for key, c in x.res:
                    cap[key] = min(cap.get(key, c), c)
            for x, r in zip(active, max_min_rates([[key for key, _ in x.res] for x in active], cap)):
                x.rate = r


#: Steps replayed at most to find the steady state under Gloo ([Note: the steady state under Gloo]).
STEADY_STATE_STEPS = 8


def simulate(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, decision: Decision, *,
             p2p: str = P2P_NCCL) -> SimResult:
    """Simulate one training step of ``decision`` (see the module note).

    ``p2p``: how boundary messages are sent ([Note: point-to-point models]):
    ``"nccl"`` (the default: the runtime's point-to-point program under
    NCCL's rules, as it runs on GPUs: fused groups run in order on each
    rank's stream, a message moves only while both ends' groups are at the
    head, and a compute waits for the whole group holding its receives),
    ``"gloo"`` (the same program as Gloo runs it, the runtime on CPU: every
    operation on its own, each message a rendezvous that leaves at
    max(send post, receive post + d)) or ``"buffered"`` (a send leaves when
    its task ends whatever the receiver posted, and the sender goes on).

    The memory policy is the decision's, as in ``solve.evaluate``
    (``decision.shard_mib`` None = the shards ``balance_shards`` picks);
    ``decision.interleave`` = v > 1: S = P v stages on P GPU groups, stage s
    on the GPUs of stage s mod P (solve/pipeline_terms.py [Note: interleaved stages]).

    Raises ValueError for a decision that does not fit the instance (as
    ``solve.evaluate``) or an unknown ``p2p``, RuntimeError if the schedule
    deadlocks (it cannot for 1F1B / GPipe) and ``ir.p2p.ProgramError``
    where the runtime would refuse the program (``"nccl"``)."""
    if p2p not in P2P_MODES:
        raise ValueError(f"simulate: p2p must be one of {', '.join(map(repr, P2P_MODES))}, got {p2p!r}")
    tab, pol = prepare(costs, devices, options, decision)
    stage_blocks, stage_gpus = decision.stage_blocks, decision.stage_gpus
    start: dict[int, float] = {}
    for _ in range(STEADY_STATE_STEPS):  # [Note: the steady state under Gloo]
        pipe = _Pipeline(costs, devices, options, decision, tab, pol, p2p, start)
        pipe.run()
        n_s, n_p = pipe.n_s, pipe.n_p
        # Gradient sync (see the module note): per group its buckets, tied parameters over their
        # holders, then each GPU's optimizer steps, then the all-gathers of the sharded stages.
        end, sync_events, shard_bytes, ends = gradient_sync(
            costs, devices, stage_blocks=stage_blocks, stage_gpus=stage_gpus,
            samples=decision.samples_per_microbatch, n_p=n_p, pol=pol, last_b=pipe.last_b,
            last_b_span=pipe.last_b_span, rc_dur=pipe.rc_dur, resources=pipe.resources,
            bucket_bytes=options.bucket_bytes, num_microbatches=decision.num_microbatches, rendezvous=pipe.gloo)
        step = max((ends[g] - start.get(g, 0.0) for g in ends), default=end)
        first = min(ends.values(), default=0.0)
        nxt = {g: t - first for g, t in ends.items() if t - first > 0}  # the next step's starts
        if not (pipe.gloo and costs.step_control_rounds) or all(
                abs(nxt.get(g, 0.0) - start.get(g, 0.0)) <= 1e-9 * max(1.0, step) for g in ends):
            break
        start = nxt
    events = pipe.events + sync_events
    used, n_g = pipe.used, devices.num_gpus
    busy_frac = tuple(pipe.busy.get(g, 0.0) / step if step > 0 else 0.0 for g in range(n_g))
    peak = [0] * n_g
    for g in used:
        state = 0
        for s in range(pipe.group_of[g], n_s, n_p):
            i, j = stage_blocks[s]
            full, shard = stage_state_kib(tab, i, j)  # a tied parameter once per stage
            mem = pol.memory[s]
            if mem.zero:  # the replicated rest (ZeRO-2: less the gradients) and the GPU's shard
                full, need = sharded_state_kib(tab, i, j, mem.zero)
                z = pol.shard_mib[s][stage_gpus[s].index(g)]
                # [C-offload]: the shard's optimizer part in host memory, its gradients / weights here
                full += offload_device_kib(z, need, shard) if mem.optimizer == "host" else MIB_UNITS * z
            elif mem.optimizer == "host":  # [C-offload]: the optimizer in host memory, float32 weights, gradients here
                full = offload_replicated_kib(tab, i, j)
            n = decision.samples_per_microbatch[s][stage_gpus[s].index(g)]
            if mem.stash == "host":  # [C-stash]: the transients beyond what the stash holds, as the objective
                state += full + transient_kib(tab, i, j, 1, stash_units(tab, s, n_s, i, j, n).device)
                continue
            state += full + transient_kib(tab, i, j, n, tab.act_prefix[j] - tab.act_prefix[i])  # [Note: gradient
            # transients] in solve/state_terms.py, as the objective adds it
        peak[g] = MEMORY_UNIT_BYTES * (state + pipe.peak_act[g])
    bubble = 1.0 - sum(busy_frac[g] for g in used) / len(used)
    events.sort(key=lambda e: (e.start_s, e.gpu, KINDS.index(e.kind), e.end_s))
    return SimResult(step_time_s=step, busy_fraction=busy_frac, peak_memory_bytes=tuple(peak),
                     events=tuple(events), bubble_fraction=bubble,
                     gpu_nodes=tuple(devices.node_names or (f"gpu{g}" for g in range(n_g))),
                     gpu_types=tuple(devices.gpu_types), memory=pol.memory, state_shard_bytes=shard_bytes,
                     interleave=pipe.v,
                     start_s=tuple(start.get(g, 0.0) for g in range(n_g)))
