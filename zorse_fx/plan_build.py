"""``build_plan`` turns a ``SolverResult`` into a ``Plan`` with generated stage
sources (each stage's ``StageMemory`` written as the plan file's fields by
``StagePlan.memory_fields``); ``Plan.decision`` reads the ``Decision`` back
(what ``solve.evaluate`` and ``sim.simulate`` take)."""

from __future__ import annotations

from collections import Counter

from .capture import BlockGraph, low_precision_params
from .cluster import Cluster
from .codegen import emit_source, split_stages
from .ir.buckets import BUCKET_BYTES, MAX_SHARD_BUCKETS_IN_FLIGHT
from .ir.decision import Decision
from .ir.result import SolverResult
from .options import PlanOptions
from .plan import GPUShare, IdleGPUs, MemoryBreakdown, Plan, SolverReport, StagePlan
from .precision import PrecisionPolicy
from .solve.state_terms import GATHERED_UNITS, max_window_sum

__all__ = ["build_plan", "memory_breakdown"]


def memory_breakdown(predicted: int, hosted: list[tuple],
                     precision: PrecisionPolicy, *, bucket_bytes: int = BUCKET_BYTES) -> MemoryBreakdown:
    """``predicted`` bytes of one GPU split by what holds them (see
    ``plan.MemoryBreakdown``). ``hosted``: per stage the GPU hosts, (its unique
    trainable parameters, this GPU's ZeRO-1 optimizer shard in bytes or None
    when the stage is not sharded, how many of the parameters are 16-bit
    working weights, how many have their gradients sharded: ZeRO-2, 0
    elsewhere). The training state is exact per parameter under
    ``precision`` (a 16-bit working weight: 2 B of weights, its float32
    master in the optimizer shard, [Note: 16-bit working weights]); on a
    ZeRO-2 stage the shard also holds the GPU's float32 gradients of those
    parameters, counted as gradients in proportion (4 B per parameter beside
    the shardable bytes of each; the others' stay whole), and its reduction
    buffers (``state_terms.grad_shard_kib``'s transient: 2 x
    ``MAX_SHARD_BUCKETS_IN_FLIGHT`` + 2 buckets of ``bucket_bytes`` at most)
    as communication. A fifth entry, when present and not None, makes the
    stage ZeRO-3: the most bytes of working weights it holds gathered (its
    largest ``GATHERED_UNITS`` consecutive units); the shard then also holds
    the GPU's weights (in proportion, as the gradients), and those are weights too. Activations are the rest of the prediction
    (what autograd saves for the micro-batches in flight, the loss block's
    backward transient, a weight gradient's transient ([Note: gradient transients]
    in ``solve/state_terms.py``), and the planner's rounding up of each block's state
    to KiB). A sixth entry, when true, offloads the stage's optimizer
    ([C-offload]): no optimizer bytes on the GPU. Bytes in, bytes out; 0
    predicted: all 0."""
    if predicted <= 0:
        return MemoryBreakdown()
    offloaded = [bool(h[5]) if len(h) > 5 else False for h in hosted]  # a sixth entry: [C-offload]
    hosted = [(*h[:4], h[4] if len(h) > 4 else None) for h in hosted]
    wide = precision.weight_bytes_per_param + precision.cast_bytes_per_param
    weights = sum((n - n16) * wide + n16 * precision.allgather_bytes_per_param16
                  for n, _, n16, _, unit in hosted if unit is None)
    grads = comm = optim = 0
    for (n, shard, n16, n_gs, unit), off in zip(hosted, offloaded):
        if shard is not None and n_gs:
            grad_b = 4 * n_gs
            shardable = precision.optimizer_bytes_per_param * (n - n16) + precision.shardable_bytes_per_param16 * n16
            w_b = (n - n16) * wide + n16 * precision.allgather_bytes_per_param16 if unit is not None else 0
            total = shardable + grad_b + w_b
            g = min(grad_b, shard * grad_b // total) if total else 0
            w = min(w_b, shard * w_b // total) if total else 0
            weights += w + (unit if unit is not None else 0)
            grads += g + (n - n_gs) * precision.grad_bytes_per_param
            optim += 0 if off else shard - g - w  # (offloaded: the optimizer's part in host memory)
            comm += ((2 * MAX_SHARD_BUCKETS_IN_FLIGHT + 2) * min(grad_b, bucket_bytes)
                     + (n - n_gs) * precision.reduce_copy_bytes_per_param)
            continue
        grads += n * precision.grad_bytes_per_param
        comm += n * precision.reduce_copy_bytes_per_param
        if not off:  # offloaded: the moments and masters are in host memory (GPUShare.predicted_host_memory_bytes)
            optim += n * precision.optimizer_bytes_per_param if shard is None else shard
    acts = max(0, predicted - weights - grads - comm - optim)
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim,
                           activations_bytes=acts, communication_bytes=comm)


def build_plan(
    bg: BlockGraph,
    cluster: Cluster,
    result: SolverResult,
    options: PlanOptions,
    *,
    model_name: str,
    label_mode: str,
    precision: PrecisionPolicy,
    planner: str,
    check=None,
    throughput_bound_s: float = 0.0,
    idle_gpus: IdleGPUs | None = None,
) -> Plan:
    """Turn a planner decision into a ``Plan`` with generated stage sources;
    ``precision`` is the policy ``bg`` was priced under (``bg``'s tensor specs
    in its autocast dtypes, as ``pricing.price`` returns it); ``check``
    (a ``sim.check.SimulationCheck``) fills ``plan.solver.simulated_*``;
    ``throughput_bound_s`` (``solve.bounds.throughput_bound_s``) fills
    ``plan.solver.throughput_bound_s`` (0: not recorded); ``idle_gpus``
    (``idle.idle_gpus``) is recorded as ``plan.idle_gpus``."""
    dec = result.decision
    programs = split_stages(bg, dec.stage_blocks)
    state = bg.captured.state()
    stages, sources = [], []
    groups = dec.num_groups
    # Ranks node by node ([Note: ranks node by node] in plan.py): the GPUs of the world (the first P stages') in
    # the cluster file's order, which lists the nodes in order and each node's GPUs in order.
    rank_of = {g: r for r, g in enumerate(sorted({g for gs in dec.stage_gpus[:groups] for g in gs}))}
    shard_bytes = dec.shard_bytes()
    n_params = [sum(state[c].numel() for c in prog.params.values()) for prog in programs]
    low, n_low, n_gs, unit_bytes = _stage_state(bg, dec, programs, state, precision)
    seq_len = int(bg.captured.example_inputs[0].shape[1]) if bg.captured.example_inputs[0].dim() > 1 else 1
    for s, prog in enumerate(programs):
        gpus = []
        for i, (g, n) in enumerate(zip(dec.stage_gpus[s], dec.samples_per_microbatch[s])):
            mem = int(result.predicted_memory_bytes[s][i]) if result.predicted_memory_bytes else 0
            gpu = cluster.gpus[g]
            # The prediction is of the GPU: every stage of its group (interleaving) at position i.
            hosted = [(n_params[t], int(shard_bytes[t][i]) if dec.memory[t].zero else None, n_low[t], n_gs[t],
                       unit_bytes[t], dec.memory[t].optimizer == "host")
                      for t in range(s % groups, len(programs), groups)]
            # [C-offload], [C-act-offload]: the objective's host bytes (of the GPU's group when interleaved).
            host = int(result.predicted_host_memory_bytes[s][i]) if result.predicted_host_memory_bytes else 0
            gpus.append(GPUShare(
                rank=rank_of[g], gpu=g, node=gpu.node, gpu_type=gpu.type, samples_per_microbatch=n,
                predicted_memory_bytes=mem, memory_capacity_bytes=int(gpu.memory_bytes),
                state_shard_bytes=int(shard_bytes[s][i]),
                predicted_memory=memory_breakdown(mem, hosted, precision, bucket_bytes=options.bucket_bytes),
                predicted_host_memory_bytes=host,
            ))
        label = bg.describe_blocks(*prog.blocks)
        stages.append(StagePlan(
            index=s,
            blocks=prog.blocks,
            label=label,
            gpus=tuple(gpus),
            input_names=prog.input_names,
            recv=prog.recv,
            send=prog.send,
            params=dict(prog.params),
            consts=dict(prog.consts),
            num_parameters=sum(state[c].numel() for c in prog.params.values()),
            source_file=f"stage_{s}.py",
            predicted_time_s=result.predicted_stage_time_s[s] if result.predicted_stage_time_s else 0.0,
            predicted_allreduce_s=result.predicted_allreduce_s[s] if result.predicted_allreduce_s else 0.0,
            low_precision_params=low[s],
            **StagePlan.memory_fields(dec.memory[s]),
        ))
        gpu_list = ", ".join(f"{gs.gpu_type}@{gs.node} x{gs.samples_per_microbatch}" for gs in gpus)
        sources.append(emit_source(prog, header=f"Plan: {model_name} on {cluster.name}; GPUs: {gpu_list}",
                                   seq_len=seq_len, model_inputs=tuple(bg.captured.input_names)))
    return Plan(
        cluster_name=cluster.name,
        cluster_gpus=cluster.gpu_summary(),
        cluster_sha256=cluster.fingerprint(),
        model_name=model_name,
        input_names=bg.captured.input_names,
        seq_len=seq_len,
        label_mode=label_mode,
        loss_reduction=programs[-1].loss_reduction,  # ([Note: the loss contract] in capture/trace.py)
        global_batch_size=options.global_batch_size,
        microbatch_size=dec.microbatch_size,
        num_microbatches=dec.num_microbatches,
        schedule=result.schedule,
        interleave=dec.interleave,
        rank_order="node",
        stages=tuple(stages),
        predicted_step_time_s=result.predicted_step_time_s,
        precision=precision.name,
        grad_reduce_dtype=precision.grad_reduce_dtype,
        tf32=precision.tf32,
        grad_bucket_bytes=options.bucket_bytes,
        solver=_solver_report(result, options, planner, check, throughput_bound_s),
        idle_gpus=idle_gpus,
        sources=tuple(sources),
    )


def _solver_report(result: SolverResult, options: PlanOptions, planner: str, check,
                   throughput_bound_s: float) -> SolverReport:
    """``Plan.solver`` of ``build_plan`` (arguments as there)."""
    return SolverReport(
        planner=planner,
        status=result.status,
        objective_s=result.objective,
        best_bound_s=result.best_bound,
        optimality_gap=result.optimality_gap,
        wall_s=result.wall_s,
        time_limit_s=options.time_limit_s,
        solver_budget=options.solver_budget,
        wall_clock_stops=result.wall_clock_stops,
        candidates=tuple(c.to_dict() for c in result.candidates),
        throughput_bound_s=throughput_bound_s,
        **({} if check is None else dict(
            simulated_step_time_s=check.simulated_step_time_s,
            simulated_max_memory_fraction=check.max_memory_fraction,
            simulated_bubble_fraction=check.bubble_fraction)),
    )


def _stage_state(bg: BlockGraph, dec: Decision, programs, state, precision: PrecisionPolicy):
    """Per stage of ``dec`` (its ``programs``): the flat names of its 16-bit working weights (the matmul
    weights of a sharded stage of >= 2 GPUs under a mixed policy), their element count, the parameters
    whose gradients ZeRO-2 shards take (those no other stage holds too; 0 below ZeRO-2) and ZeRO-3's
    gathered working-weight bytes (the largest unit window; None below ZeRO-3). ``state``: the captured
    model's tensors by canonical name."""
    eligible = low_precision_params(bg) if precision.mixed else frozenset()
    low = [tuple(flat for flat, canon in prog.params.items() if canon in eligible)
           if dec.memory[s].zero and len(dec.stage_gpus[s]) > 1 else () for s, prog in enumerate(programs)]
    n_low = [sum(state[prog.params[flat]].numel() for flat in low[s]) for s, prog in enumerate(programs)]
    # ZeRO-2: the parameters whose gradients the shards take (not held by another stage as well).
    held = Counter(canon for prog in programs for canon in set(prog.params.values()))
    n_gs = [sum(state[canon].numel() for canon in set(prog.params.values()) if held[canon] == 1)
            if dec.memory[s].zero >= 2 else 0 for s, prog in enumerate(programs)]
    # ZeRO-3: the working-weight bytes of each stage's largest unit ([Note: ZeRO-3 units] in codegen/split.py).
    wide = precision.weight_bytes_per_param + precision.cast_bytes_per_param

    def gathered(s, prog) -> int:
        """The largest GATHERED_UNITS consecutive units, plus every unit read again after the next
        one's first read (a tied weight: gathered throughout) ([C-param-shard])."""
        units = prog.param_units()
        order = {n.name: k for k, n in enumerate(prog.graph.nodes)}
        sizes = [sum(state[prog.params[f]].numel() * (precision.allgather_bytes_per_param16 if f in low[s] else wide)
                     for f in flats) for flats, _, _ in units]
        spans = [u for u in range(len(units) - 1) if order[units[u][2]] > order[units[u + 1][1]]]
        return max_window_sum(sizes, GATHERED_UNITS) + sum(sizes[u] for u in spans)

    unit_bytes = [gathered(s, prog) if dec.memory[s].zero == 3 else None for s, prog in enumerate(programs)]
    return low, n_low, n_gs, unit_bytes
