"""The network terms of the objective (``objective.py``'s module note
"step-time model" is the model; these are its helpers): the pair bandwidth
with shared links (``effective_pair_bandwidth``, used by ``build_tables``),
the ring factor of [C-allreduce] (``ring_units``),
the sync offsets of [C-objective] (``drain_offsets``, ``last_bucket_kib``)
and the tied-parameter all-reduce of [C-tied] (``tied_terms``). The CP-SAT
model (``model.py``; these terms in ``_sync_encoding.py``) encodes the same terms.

[Note: shared links in the objective]
A link that several GPU pairs share (``DeviceGraph.shared_links``: a region's
WAN uplink, a node's NIC; one capacity per direction) enters the objective
through the pair bandwidth only: ``effective_pair_bandwidth`` gives every
pair bw(g, h) = min(its own link (smaller direction), the capacity of every
shared link the pair crosses), and ``build_tables`` classes pairs by that
figure, so the CP-SAT model, the DP and the class refinement of
``grouped.gpu_classes`` (links with equal codes are interchangeable) see it
without a term of their own. Why that is what sharing means here:
  * [C-boundary] charges ALL of the micro-batch's cut bytes on a pair whose
    flows cross a shared link with several nodes on either side ([Note: boundary rows]), as if
    they queued on one link. When a stage pair straddles a shared link, the bytes crossing
    it are at most all of them, and a shared link moves them at most at its
    capacity, so bytes / min(pair link, capacity) bounds the time the
    boundary keeps that link busy -- exactly when every route of the
    boundary crosses it (two stages in two regions: the simulator's max-min
    rates give the routes capacity / routes each, total bytes / capacity).
    A shared link with one node on a side (a NIC, a cloud's per-instance cap to another region)
    carries only that node's rows: the pair is charged the larger of its two nodes' rows
    (since 2026-12-07; before, all b, so a boundary between two regions of per-node caps was
    priced as if one path carried it: issue 50).
  * [C-allreduce] is a ring over the stage's GPUs in stage order
    (``sim/network.py``). A ring whose GPUs of each side are consecutive
    crosses a shared link once per direction, so its crossing hop gets the
    whole capacity: its slowest hop's bandwidth is min(pair link, capacity)
    of that hop, >= the objective's slowest pair of the stage.
Where it is NOT an upper bound: a ring whose order alternates between the
two sides crosses the link r > 1 times per direction and the simulator gives
each crossing capacity / r; two boundaries crossing one shared link in the
same direction at the same moment (stages alternating between regions)
share it in the simulator and not here; and boundary messages and rings that
cross a NIC together. Those plans are priced optimistically by up to the
factor of crossings; the simulator (``zorse_fx.sim``) prices them.

[Note: boundary rows]
[C-boundary] charges one micro-batch's cut bytes, forward and backward, on the
link that takes longest. The runtime (``ir.p2p.routes``) and the simulator
send each GPU's rows of the micro-batch to the GPUs of the next stage that
hold those rows: a route carries the overlap of two row ranges; the routes
from one node to another share that node pair's link in that direction, those
inside a node each have the GPU pair's link (``sim/network.link_resource``;
links are full duplex). So the samples a link carries in one direction per
message are at most (``boundary_rows``, codes ``pair_rows``):
  * a GPU pair on one node: min(n_g, n_h) (the overlap of two ranges);
  * two nodes N, N': max(min(S_N, S'_N'), min(S_N', S'_N)), S_N the samples of
    the sending stage's GPUs on N and S'_N' those of the receiving stage's
    GPUs on N' (the routes N -> N' carry the overlap of the two unions of
    ranges, those N' -> N, when both stages have GPUs on both nodes, go the
    other way at the same time on the other direction);
  * a pair whose flows cross a shared link with several nodes on either side (a region's one
    WAN path): all b, as several node pairs may share the link ([Note: shared links in the
    objective]);
  * a pair whose flows cross only shared links with one node on a side (that node's NIC, its cap to
    another region):
    max(S_N, S'_N'), S_N the sending stage's samples on g's node and S'_N' the receiving stage's on
    h's node: whatever the routes, a node's own link carries that node's rows and no more.
The boundary's transfer is the max over the two stages' GPU pairs of
rows(g, h) x ``xfer1[class(g, h)][cut]`` (one sample's bytes / bw(g, h),
rounded once per sample), its latency the max over the pairs.
These bound each link's bytes from above; the exact count depends on the
order of the row ranges, which the CP-SAT model and the DP do not see.
Charging all b samples on every pair overcounts a stage spread over several
GPUs by up to their number (the Metis scenario's FlashFlex plan, a 1-GPU
stage feeding 5 GPUs on two nodes: simulated / objective 0.580). The stage
DP and the interleave pass price all b samples (``IntTables.xfer`` = b x
``xfer1``): an upper bound of this term; their plans are scored by
``evaluate``.
Per micro-batch each direction of a node pair's link carries, for every
boundary s on it, the forward rows one way and the gradients of the rows that
went the other way: min(S_N, S'_N') + min(S_N', S'_N) samples
(``boundary_rows(..., both_ways=True)``). Its busiest direction's time,
sum_s of those rows x xfer1_s (``link_load``), bounds [C-objective]'s
steady-state period (``pipeline_period``; 1F1B / GPipe, v = 1). A link one
boundary uses never binds (its load <= 2 x max rows x xfer1 <= boundary_s);
one that carries two boundaries (a node holding GPUs of two stages that both
exchange with the other node) can: without it the Metis baseline's plan (two
boundaries on the T4-A100 node pair) was 33% optimistic. In the CP-SAT model only links with
a node holding >= 2 GPUs of one-node groups can carry two boundaries (a GPU
alone on its node, and a merged node, is in one stage), so only those get the
term (``_boundary_encoding.LinkTerms.loads``). Not priced: a GPU pair's own link inside a node
carrying several boundaries (interleaved plans only) and shared links (WAN, NIC)
carrying several boundaries.

[Note: pipeline period]
The steady-state period T of [C-objective] (step = sum_s t_s + (M - 1) T +
sync, v = 1) prices the point-to-point program the runtime runs on GPUs
(``ir/p2p.py`` [Note: point-to-point program], under NCCL's rules; the
simulator's ``p2p="nccl"``, [Note: point-to-point models] in sim/engine.py).

1F1B. A stage alternates compute and a fused exchange with each neighbour:
after F(i + S - 1 - s) it sends the activations right and receives the
gradient of B(i) from stage s + 1, which runs B(i) then F(i + S - 1 - s) and
posts the opposite pair in one group; after B(i) it sends the gradient left
and receives the next forward's activations from s - 1. The two messages of
an exchange use the two directions of a full-duplex link at once, so an
exchange takes h_s = boundary_s / 2 (one direction's rows x transfer +
latency, [C-boundary]); a compute waits for its whole group, so neither the
exchange nor the neighbour's readiness overlaps the stage's compute. Each
stage's cycle of one micro-batch is F, exchange right, B, exchange left:

    T = max(max_s (cmax_s + h_{s-1} + h_s), load)      (h_{-1} = h_{S-1} = 0)

(cycles through several stages average these and are no longer). load:
``link_load``, a node pair link's busiest direction per micro-batch.

GPipe. All forwards, then all backwards; a stage's receive is posted in the
group just before the compute that needs it, so a message moves only once its
receiver has finished its previous compute, and a compute waits for its group
(its receive and its previous compute's send, on two links at once). Per
micro-batch the forward phase takes T_F and the backward phase T_B:

    T_F = max(F_0, h_0, max_{s >= 1} (F_s + max(h_{s-1}, h_s)))
    T_B = max(B_{S-1}, h_{S-2}, max_{s <= S-2} (B_s + max(h_{s-1}, h_s)))
    T   = max(ceil(T_F + T_B), load)

(the first stage of a phase has no receive: it computes back to back while its
sends queue on its stream, one after another). F_s / B_s: the slowest GPU's
forward (1/3 of its compute without the re-run) and backward (2/3 + the re-run
forward of a recomputing stage), each maxed over the stage's GPUs; in units
of 1/3 ns (``split``) and rounded up once.

Measured against the simulator's NCCL program (bench/README.md "The
runtime's NCCL program in the simulator"): a node pair's link that carries
two boundaries needs no term of its own in either schedule -- the exchanges
keep the stages in lock step, so the boundaries take turns on the link
(tests/test_boundary_rows.py).

Why not a form for buffered sends (a stage computes while its messages move,
as on Gloo: T = max(max_s boundary_s, every window's 1F1B cycle average
ceil((sum_{j=s..e} t_j - boundary_e) / (e - s + 1)), load)): against the
runtime's NCCL program it is up to 6% optimistic on the planners' own 1F1B
plans (AMP), 30% on others and up to 28% on GPipe plans (bench/README.md
"The runtime's NCCL program in the simulator").
"""

from __future__ import annotations

import numpy as np

from ..ir.devices import DeviceGraph

__all__ = ["ROWS_SAME_NODE", "ROWS_NODE_SUMS", "ROWS_ALL", "ROWS_NODE_TOTAL", "pair_row_codes", "boundary_rows",
           "link_load",
           "pipeline_period",
           "effective_pair_bandwidth", "ring_units", "last_bucket_kib", "untied_block_kib", "drain_offsets",
           "tied_terms"]


def _crossing(devices: DeviceGraph):
    """Per shared link ``(cross, capacity, one_node_side)``: (G, G) bool, a flow g -> h crosses it (either
    direction); its capacity (bytes/s per direction); whether one of its sides is one node (a NIC, a node's
    cap to another region; GPUs without node names are each a node of their own)."""
    n_g = devices.num_gpus
    names = devices.node_names or tuple(f"gpu{g}" for g in range(n_g))
    out = []
    for sl in devices.shared_links:
        a, b = np.zeros(n_g, dtype=bool), np.zeros(n_g, dtype=bool)
        a[list(sl.gpus_a)], b[list(sl.gpus_b)] = True, True
        out.append((np.outer(a, b) | np.outer(b, a), sl.bandwidth_bytes_per_s,
                    len({names[g] for g in sl.gpus_a}) == 1 or len({names[g] for g in sl.gpus_b}) == 1))
    return out


def effective_pair_bandwidth(devices: DeviceGraph) -> list[list[float]]:
    """(G, G) bytes/s of each GPU pair as the objective prices it ([Note: shared
    links in the objective]): the smaller direction of the pair's own link,
    capped by the capacity of every shared link (``DeviceGraph.shared_links``)
    the pair crosses in either direction; 0.0 on the diagonal. (Matrices over
    the pairs, one per shared link: 128 GPUs and 2 links in milliseconds.)

    Raises:
        ValueError: a pair's link bandwidth is not > 0."""
    n_g = devices.num_gpus
    link = np.asarray(devices.link_bw_bytes_per_s, dtype=np.float64).reshape(n_g, n_g)
    bw = np.minimum(link, link.T)
    off = ~np.eye(n_g, dtype=bool)
    bad = np.argwhere(off & ~(bw > 0))
    if len(bad):
        g, h = (int(x) for x in bad[0])
        raise ValueError(f"link bandwidth between GPU {g} and {h} must be > 0, got {bw[g, h]}")
    for cross, cap, _ in _crossing(devices):
        bw = np.where(cross, np.minimum(bw, cap), bw)
    bw[~off] = 0.0
    return bw.tolist()


#: [Note: boundary rows] codes of ``IntTables.pair_rows``.
ROWS_SAME_NODE, ROWS_NODE_SUMS, ROWS_ALL, ROWS_NODE_TOTAL = 0, 1, 2, 3


def pair_row_codes(devices: DeviceGraph) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """((G,) node index of each GPU, (G, G) row code of each pair) of [Note: boundary rows].

    Nodes are ``devices.node_names`` (each GPU its own node without them, as
    ``sim/network.link_resource``); the code of (g, h), g != h, is ROWS_ALL when
    a flow between them crosses a shared link with several nodes on either side (a region's
    one path), else ROWS_NODE_TOTAL when it crosses shared links of one node on a side (a NIC, a
    node's cap to another region), else ROWS_SAME_NODE on one node and ROWS_NODE_SUMS on two; -1 on
    the diagonal."""
    n_g = devices.num_gpus
    names = devices.node_names or tuple(f"gpu{g}" for g in range(n_g))
    index = {name: k for k, name in enumerate(dict.fromkeys(names))}
    node = tuple(index[name] for name in names)
    nd = np.asarray(node)
    codes = np.where(nd[:, None] == nd[None, :], ROWS_SAME_NODE, ROWS_NODE_SUMS)
    crossings = _crossing(devices)
    for cross, _, one_node in crossings:
        if one_node:
            codes = np.where(cross, ROWS_NODE_TOTAL, codes)
    for cross, _, one_node in crossings:
        if not one_node:
            codes = np.where(cross, ROWS_ALL, codes)
    np.fill_diagonal(codes, -1)
    return node, tuple(tuple(int(c) for c in row) for row in codes)


def boundary_rows(tab, src, src_n, dst, dst_n, *, both_ways: bool = False) -> list[tuple[tuple[int, int], int]]:
    """[Note: boundary rows]: ``[((g, h), rows)]``, |src| x |dst| entries, for
    every GPU pair g of the sending stage (GPUs ``src``, samples ``src_n`` per
    micro-batch, aligned) and h of the receiving one: the samples (an int in
    [0, b]) of one micro-batch's message the pair's link carries at most in one
    direction, from ``tab.pair_rows`` (``ROWS_ALL``: the micro-batch size b;
    ``ROWS_SAME_NODE``: min(n_g, n_h); ``ROWS_NODE_SUMS``: the larger overlap
    of the two stages' sample sums on the two nodes, or with ``both_ways``
    the sum of both overlaps: what one direction carries per micro-batch,
    forward rows one way and gradients of the other way's rows;
    ``ROWS_NODE_TOTAL``: the larger of the sending stage's samples on g's node
    and the receiving stage's on h's node, what each node's own shared link
    carries that way at most, or with ``both_ways`` each node's rows out plus
    the gradients of the rows it received)."""
    s_src, s_dst = {}, {}
    for sums, gpus, ns in ((s_src, src, src_n), (s_dst, dst, dst_n)):
        for g, n in zip(gpus, ns):
            sums[tab.gpu_node[g]] = sums.get(tab.gpu_node[g], 0) + n
    out = []
    for g, ng in zip(src, src_n):
        for h, nh in zip(dst, dst_n):
            code = tab.pair_rows[g][h]
            x, y = tab.gpu_node[g], tab.gpu_node[h]
            if code == ROWS_ALL:
                rows = tab.microbatch_size
            elif code == ROWS_SAME_NODE:
                rows = min(ng, nh)
            elif code == ROWS_NODE_TOTAL:
                rows = (max(s_src[x] + s_dst.get(x, 0), s_dst[y] + s_src.get(y, 0)) if both_ways
                        else max(s_src[x], s_dst[y]))
            else:
                there, back = min(s_src[x], s_dst[y]), min(s_src.get(y, 0), s_dst.get(x, 0))
                rows = there + back if both_ways else max(there, back)
            out.append(((g, h), rows))
    return out


def link_load(tab, stage_blocks, rows_per_boundary) -> int:
    """[Note: boundary rows] load of the node pair links (pairs coded
    ``ROWS_NODE_SUMS``) over every boundary of one micro-batch: the busiest
    link's one direction (ns units), max over node pairs {N, N'} of sum over
    boundaries s of rows_s x the largest ``xfer1`` at cut s of a GPU pair on
    the link in boundary s (0 if none).
    ``rows_per_boundary[s]``: ``boundary_rows(..., both_ways=True)`` of the
    boundary after stage s (S - 1 lists); every pair of one node pair has the
    same rows."""
    loads: dict[tuple[int, int], int] = {}
    node = tab.gpu_node
    for (_, j), pairs in zip(stage_blocks, rows_per_boundary):
        on_link = {}
        for (g, h), rows in pairs:
            if tab.pair_rows[g][h] == ROWS_NODE_SUMS:
                key = (min(node[g], node[h]), max(node[g], node[h]))
                on_link[key] = (rows, max(on_link.get(key, (0, 0))[1], tab.xfer1[tab.pair_bw_class[g][h]][j]))
        for key, (rows, x) in on_link.items():
            loads[key] = loads.get(key, 0) + rows * x
    return max(loads.values(), default=0)


def pipeline_period(compute, boundary, load: int, schedule: str = "1f1b", split=None) -> int:
    """[Note: pipeline period] T (units) of stages with slowest-GPU ``compute``
    and ``boundary`` terms (per stage, [C-boundary], 0 for the last; even: two
    one-way terms) and the busiest node pair link's ``load`` (``link_load``,
    one direction), under ``schedule`` ("1f1b" or "gpipe"). GPipe also needs
    ``split`` = (fwd3, bwd3): per stage 3 x the forward and 3 x the backward
    (the recomputed forward included) of its slowest GPU, each maxed over the
    stage's GPUs on its own (``objective.evaluate_units``).

    Raises:
        ValueError: an unknown schedule, or GPipe without ``split``."""
    n = len(compute)
    h = [b // 2 for b in boundary] + [0]  # h[-1] = h[n - 1] = 0: no boundary outside the pipeline
    if schedule == "1f1b":
        return max(max(compute[s] + h[s - 1] + h[s] for s in range(n)), load)
    if schedule != "gpipe" or split is None:
        raise ValueError(f"pipeline_period: schedule {schedule!r} (GPipe needs split=(fwd3, bwd3))")
    fwd3, bwd3 = split
    t_f = max(fwd3[0], 3 * h[0], *(fwd3[s] + 3 * max(h[s - 1], h[s]) for s in range(1, n)))
    t_b = max(bwd3[n - 1], 3 * h[n - 2], *(bwd3[s] + 3 * max(h[s - 1], h[s]) for s in range(n - 1)))
    return max(-(-(t_f + t_b) // 3), load)


def ring_units(units: int, k: int, scale: int = 1) -> int:
    """ceil(units * (k - 1) / (k * scale)): the bandwidth term of a ring collective
    over k GPUs whose whole payload would take ``units`` on the slowest link
    ([C-allreduce]); ``scale`` > 1 when ``units`` are 1/scale ns (the last
    bucket's table of [C-objective], ``IntTables.lastb_scale``). 0 for k <= 1."""
    return -(-units * (k - 1) // (k * scale)) if k > 1 else 0


def last_bucket_kib(grad_kib: int, caps: tuple[int, int]) -> int:
    """KiB of the last gradient bucket of a stage with ``grad_kib`` KiB of float32
    gradients (G_s of [C-allreduce], ``caps`` = (first_cap, cap) in KiB): with e =
    nb - 1 = max(0, ceil((G - first_cap) / cap)) buckets after the first, G when
    e = 0, else G - first_cap - (e - 1) cap (in (0, cap]). The runtime fills the
    buckets in backward order, so the last one holds the stage's earliest
    parameters and is ready only when its last backward ends ([C-objective])."""
    first, cap = caps
    e = max(0, -(-(grad_kib - first) // cap))
    return grad_kib - cap * e + (cap - first) * (e >= 1)


def untied_block_kib(tab) -> list[int]:
    """Per block q: its float32 gradient KiB (``tab.grad_kib_prefix``, rounded up)
    less every tied parameter it reads (``tab.tied_grad_kib``, rounded down), so
    >= 0 and <= G_s of any stage starting at q. A stage's first block's
    gradients are ready only when the stage's backward ends, so its buckets
    holding them wait for it: [C-objective]'s L_s counts max(last_kib_s, this
    of the stage's first block). Leaving out every tied copy keeps it a lower
    bound of those buckets whichever copy [C-tied] keeps in the stage's ring."""
    pre = tab.grad_kib_prefix
    out = [pre[q + 1] - pre[q] for q in range(len(pre) - 1)]
    for t, blocks in enumerate(tab.tied_blocks):
        for q in blocks:
            out[q] -= tab.tied_grad_kib[t]
    return out


def drain_offsets(compute, boundary, extra=None, k_e: int = 4) -> tuple[int, ...]:
    """D_s of [C-objective] (units): floor(E_s / 6), E_s = sum_{j<s} (k_e compute_j
    + 3 boundary_j), a lower bound of the time from stage s's last backward to
    stage 0's (``compute`` = per-stage slowest GPU's compute, ``boundary`` as
    [C-boundary]); with ``extra`` (per stage, units): floor((E_s + extra_s) / 6).
    ``k_e``: 6 x the least backward share of a stage's compute
    (``IntTables.drain_coefs[0]``: 4 with the backward at twice the forward;
    the text below speaks of that split).

    Why: the runtime and the simulator (``sim/sync.py``) start each gradient
    bucket of a stage as soon as its last backward has produced it. The last
    micro-batch's backward walks from stage S-1 down to 0, so after stage s's
    last backward each stage j < s still receives the gradient (half of
    boundary_j) and runs its backward: 2/3 of compute_j without recomputation,
    3/4 with it (the re-run forward), so >= 2/3 cmax_j either way; D_s is a
    lower bound of that drain in the model's own terms (a stage at its slowest
    GPU, a boundary at its [C-boundary] price; the simulator routes rows, so
    its drain can be shorter where a GPU receives from a faster one or on a
    faster link). Stage s's own backward runs its blocks in reverse, its last
    block first, and a block's gradients are ready when its backward ends (the
    runtime's hook; ``sim/sync.py``'s ``_Timing.block_done``), so nothing of
    stage s can be all-reduced before its last block's backward ends on every
    GPU: with g* the GPU that ends last, the tail after it is >= allreduce_s -
    max_g bwd_g(blocks i..j-2). Every bucket but the last (it holds the stage's
    earliest parameters) can start during the backward of those blocks, which
    lasts at most B6_s / 6 = (4 - rc_s) cmax-_s / 6 (2/3 of their compute, 1/2
    with recomputation; cmax-_s = the slowest GPU's compute over the stage's
    blocks but its last, 0 for a one-block stage), so the all-reduce gets
    floor((E_s + B6_s) / 6). The buckets holding the stage's first block's
    gradients wait for the whole backward, so L_s, the ring of the larger of
    the last bucket and that block's gradients (and a sharded stage's
    all-gather), gets D_s. A tied parameter's ring waits for all its holders
    (usually stage 0), so tied_s has no offset. Measured by
    bench/objective_vs_sim.py (bench/README.md "Gradient sync overlapping the
    pipeline drain", "Gradient buckets overlapping the stage's own last
    backward"), simulated / objective: every sync after the whole drain,
    median 0.950 on 56 plans (0.957 with D_s); B6_s over the whole stage
    ((4 - rc_s) cmax_s) is optimistic on single-stage plans of few large
    blocks (max 1.281; random seed 36: blocks of 20M and 148M parameters, the
    bulk ready only after the second's backward); L_s without the first
    block's buckets, max 1.093 (seeds 6, 15, 34)."""
    out, acc = [], 0
    for s, (c, b) in enumerate(zip(compute, boundary)):
        out.append((acc + (extra[s] if extra else 0)) // 6)
        acc += k_e * c + 3 * b
    return tuple(out)


def tied_terms(tab, stage_blocks, stage_gpus, num_groups: int | None = None):
    """[C-tied] of a decision: ``(excluded, tied)``. ``excluded[s]``: {tied
    parameter index: copies of it stage s's own all-reduce leaves out};
    ``tied[s]``: the largest all-reduce over the union of its holders of the
    tied parameters stage s holds and that two GPU groups hold (None if none).
    ``num_groups``: GPU groups (stage s on group s mod P; default one per stage)."""
    n_s = len(stage_blocks)
    groups = num_groups or n_s
    stage_of = {b: s for s, (i, j) in enumerate(stage_blocks) for b in range(i, j)}
    excluded: list[dict[int, int]] = [{} for _ in range(n_s)]
    tied: list[int | None] = [None] * n_s
    for t, blocks in enumerate(tab.tied_blocks):
        stages = sorted({stage_of[b] for b in blocks})
        one = len({s % groups for s in stages}) == 1
        for b in (blocks[1:] if one else blocks):  # one holder: reduced once, with its own gradients
            excluded[stage_of[b]][t] = excluded[stage_of[b]].get(t, 0) + 1
        if one:
            continue
        union = tuple(dict.fromkeys(g for s in stages for g in stage_gpus[s]))
        pairs = [(g, h) for a, g in enumerate(union) for h in union[a + 1:]]
        k = len(union)
        units = ring_units(max(tab.tied_ar[t][c] for c in {tab.pair_bw_class[g][h] for g, h in pairs}), k) \
            + 2 * (k - 1) * max(tab.pair_lat[g][h] for g, h in pairs)
        for s in stages:
            tied[s] = units if tied[s] is None else max(tied[s], units)
    return excluded, tied
