"""Mechanism shared by the baseline planners (policy lives in one module per method).

Every baseline proposes concrete decisions (stage blocks, stage GPUs, samples
per GPU, micro-batch count) and lets :class:`Selector` score them with the
planners' own step-time model (``zorse_fx.solve.objective``), so a baseline and
the CP-SAT planner are compared on exactly the same numbers.

[Note: how a baseline picks among its candidates]
A method that enumerates choices (pipeline degree, micro-batch count, GPU
grouping) keeps the candidate with the smallest predicted step time among
those ``evaluate`` accepts (memory fits, no idle GPU when idling is not
allowed, at most ``max_stages`` stages); ties: fewer stages, then fewer
micro-batches (as the solver). If no candidate is accepted, the fastest
candidate is returned anyway with status "BASELINE_INFEASIBLE" and its
violations in the ``candidates`` entry marked ``"chosen": True``, so a
benchmark can report the method as infeasible instead of dropping it.

Legend: ``B`` blocks, ``G`` GPUs, ``S`` stages, ``M`` micro-batches, ``b`` =
samples per micro-batch. Times in seconds unless a name says ``units`` (1 ns).
"""

from __future__ import annotations

import time

from ..errors import InfeasiblePlanError
from ..solve.objective import UNIT_S, build_tables, evaluate, evaluate_units
from ..solve.records import BlockCosts, DeviceGraph, SolverOptions, SolverResult

__all__ = ["Selector", "gpu_speeds", "largest_remainder", "proportional_cuts", "reference_block_work",
           "bandwidth", "min_max_partition"]


def gpu_speeds(costs: BlockCosts, devices: DeviceGraph) -> tuple[float, ...]:
    """``(G,)`` samples/s of each GPU on the whole model: 1 / sum of its type's
    per-sample block times (fixed per-micro-batch costs ignored)."""
    total = {t: sum(costs.fwd_bwd_s_per_sample[t]) for t in set(devices.gpu_types)}
    return tuple(1.0 / total[t] if total[t] > 0 else float("inf") for t in devices.gpu_types)


def bandwidth(devices: DeviceGraph, g: int, h: int) -> float:
    """Link bandwidth between GPUs g and h in bytes/s (slower direction, as the model)."""
    return min(devices.link_bw_bytes_per_s[g][h], devices.link_bw_bytes_per_s[h][g])


def largest_remainder(total: int, weights, minimum: int = 1) -> tuple[int, ...]:
    """Integers >= ``minimum`` summing to ``total``, proportional to ``weights``
    (Hamilton / largest-remainder method; ties go to the lower index). Entries
    that round below ``minimum`` are raised to it, taking one at a time from
    the entry most above its quota. Raises ValueError if ``total`` is too small."""
    w = [float(x) for x in weights]
    n = len(w)
    if n == 0 or total < minimum * n:
        raise ValueError(f"cannot give {n} parts >= {minimum} each out of {total}")
    wsum = sum(w)
    quota = [total * x / wsum for x in w] if wsum > 0 else [total / n] * n
    out = [int(q) for q in quota]
    for i in sorted(range(n), key=lambda i: (-(quota[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    for i in range(n):
        while out[i] < minimum:
            j = max((j for j in range(n) if out[j] > minimum), key=lambda j: (out[j] - quota[j], -j))
            out[j] -= 1
            out[i] += 1
    return tuple(out)


def reference_block_work(costs: BlockCosts, devices: DeviceGraph) -> tuple[float, ...]:
    """``(B,)`` each block's share of the model's per-sample work, averaged over
    the GPU types present (so a proportional split does not favour one type)."""
    types = sorted(set(devices.gpu_types))
    nb = costs.num_blocks
    out = [0.0] * nb
    for t in types:
        w = costs.fwd_bwd_s_per_sample[t]
        tot = sum(w) or 1.0
        for k in range(nb):
            out[k] += w[k] / tot / len(types)
    return tuple(out)


def proportional_cuts(block_weights, shares) -> tuple[tuple[int, int], ...]:
    """Split blocks into ``len(shares)`` contiguous non-empty ranges whose
    weight fractions follow ``shares``: cut ``s`` goes to the block boundary
    whose cumulative weight fraction is nearest to the cumulative share
    (clamped so every range keeps >= 1 block)."""
    nb, n_s = len(block_weights), len(shares)
    if not 1 <= n_s <= nb:
        raise ValueError(f"cannot split {nb} blocks into {n_s} non-empty stages")
    tot_w = sum(block_weights)
    pre = [0.0]
    for x in block_weights:
        pre.append(pre[-1] + (x / tot_w if tot_w > 0 else 1.0 / nb))
    tot_s = sum(shares)
    cuts, acc = [0], 0.0
    for s in range(n_s - 1):
        acc += shares[s] / tot_s
        lo, hi = cuts[-1] + 1, nb - (n_s - 1 - s)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(pre[c] - acc), c)))
    cuts.append(nb)
    return tuple((cuts[s], cuts[s + 1]) for s in range(n_s))


def min_max_partition(nb: int, n_s: int, cost, fits=lambda s, i, j: True):
    """Contiguous split of ``nb`` blocks into ``n_s`` non-empty ranges minimising
    ``max_s cost(s, i, j)`` (dynamic program, O(S B^2) calls). Ranges with
    ``fits(s, i, j)`` False are excluded; returns None if no split fits."""
    inf = float("inf")
    best = [[inf] * (nb + 1) for _ in range(n_s + 1)]
    arg = [[-1] * (nb + 1) for _ in range(n_s + 1)]
    best[0][0] = 0
    for s in range(n_s):
        for j in range(s + 1, nb - (n_s - 1 - s) + 1):
            for i in range(s, j):
                if best[s][i] == inf or not fits(s, i, j):
                    continue
                v = max(best[s][i], cost(s, i, j))
                if v < best[s + 1][j]:
                    best[s + 1][j], arg[s + 1][j] = v, i
    if best[n_s][nb] == inf:
        return None
    parts, j = [], nb
    for s in range(n_s, 0, -1):
        parts.append((arg[s][j], j))
        j = arg[s][j]
    return tuple(parts[::-1])


class Selector:
    """Scores candidate decisions with the shared model; keeps the best per
    (S, M) and overall (see [Note: how a baseline picks among its candidates])."""

    def __init__(self, name: str, costs: BlockCosts, devices: DeviceGraph, options: SolverOptions):
        self.name, self.costs, self.devices, self.options = name, costs, devices, options
        self.t0 = time.perf_counter()
        self._tables: dict[int, object] = {}
        #: {(S, M): (rank key, decision)}; rank key = (infeasible?, step units).
        self._best: dict[tuple[int, int], tuple[tuple[int, int], tuple]] = {}

    def tables(self, m: int):
        """Integer tables of the model for M micro-batches (cached)."""
        if m not in self._tables:
            self._tables[m] = build_tables(self.costs, self.devices, self.options, m)
        return self._tables[m]

    def add(self, stage_blocks, stage_gpus, samples, m: int) -> int:
        """Score one decision; returns its step time in units (1 ns)."""
        tab = self.tables(m)
        dec = (tuple(map(tuple, stage_blocks)), tuple(map(tuple, stage_gpus)), tuple(map(tuple, samples)), m)
        u = evaluate_units(tab, dec[0], dec[1], dec[2])
        ok = all(need <= tab.cap_bytes[g] for gs, needs in zip(dec[1], u.memory) for g, need in zip(gs, needs))
        ok &= len(dec[0]) <= self.options.max_stages
        ok &= self.options.allow_idle_gpus or sum(map(len, dec[1])) == self.devices.num_gpus
        key, s_m = (0 if ok else 1, u.step), (len(dec[0]), m)
        if s_m not in self._best or key < self._best[s_m][0]:
            self._best[s_m] = (key, dec)
        return u.step

    def result(self, why_none: str = "") -> SolverResult:
        """The chosen decision as a SolverResult (status BASELINE / BASELINE_INFEASIBLE).
        Raises InfeasiblePlanError if no candidate was formed."""
        if not self._best:
            raise InfeasiblePlanError(f"{self.name}: no candidate plan can be formed: {why_none}")
        # Feasible first, then step time, then fewer stages, then fewer micro-batches.
        s_m = min(self._best, key=lambda k: (self._best[k][0], k))
        cands = []
        for k in sorted(self._best):
            (bad, step), (blocks, gpus, samples, m) = self._best[k]
            ev = evaluate(self.costs, self.devices, self.options, stage_blocks=blocks, stage_gpus=gpus,
                          samples_per_microbatch=samples, num_microbatches=m)
            assert ev.objective_units == step and ev.feasible == (not bad), (ev, step, bad)
            cands.append({"num_stages": k[0], "num_microbatches": k[1], "method": self.name,
                          "status": "BASELINE" if ev.feasible else "BASELINE_INFEASIBLE",
                          "step_time_s": step * UNIT_S, "feasible": ev.feasible,
                          "violations": list(ev.violations), "chosen": k == s_m})
            if k == s_m:
                chosen = (blocks, gpus, samples, m, ev)
        blocks, gpus, samples, m, ev = chosen
        obj = ev.objective_units
        return SolverResult(
            stage_blocks=blocks, stage_gpus=gpus, samples_per_microbatch=samples, num_microbatches=m,
            microbatch_size=self.options.global_batch_size // m, schedule=self.options.schedule,
            predicted_step_time_s=ev.step_time_s, predicted_stage_time_s=ev.stage_time_s,
            predicted_allreduce_s=ev.allreduce_s, predicted_memory_bytes=ev.memory_bytes,
            status="BASELINE" if ev.feasible else "BASELINE_INFEASIBLE", objective=obj * UNIT_S,
            # No lower bound is known: bound 0, gap (obj - 0) / obj = 1.
            best_bound=0.0, optimality_gap=1.0 if obj > 0 else 0.0,
            wall_s=time.perf_counter() - self.t0, candidates=tuple(cands))
