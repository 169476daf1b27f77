"""A captured model priced on a cluster, once, as every later phase reads it.

``price(captured, cluster, options)`` resolves the plan's precision, cuts the
graph into blocks, measures activations under that precision's autocast,
prices every block on every GPU type of the cluster (from a measured kernel
profile where the type has one, else the per-class model of
``cost/gpu_model.py``) and builds the device graph, loading the profiles
once. The planner, ``zorse simulate``, the demo and the benchmarks all start
from the ``PricedModel`` it returns; ``simulate_plan`` replays an exported
plan on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .capture import BlockGraph, CapturedModel, analyse
from .cluster import Cluster
from .cost.calibration import Calibration, apply_calibration, read_calibration
from .cost.measured import ProfileSet, measured_block_costs
from .cost.roofline import block_costs, saved_activations_or_estimate
from .errors import PlanOptionsError
from .ir.costs import BlockCosts
from .ir.devices import DeviceGraph
from .options import PlanOptions
from .options import checked_policy as _policy
from .precision import PrecisionPolicy, check_supported, default_precision
from .sim.engine import SimResult, simulate

__all__ = ["PricedModel", "price", "simulate_plan", "evaluate_plan", "plan_costs", "resolve_precision",
           "options_for_plan", "device_graph", "CLASS_MODEL"]

#: ``PricedModel.cost_sources`` of a GPU type priced without a measured profile.
CLASS_MODEL = "class model"


@dataclass(frozen=True, slots=True, kw_only=True)
class PricedModel:
    """A model priced on a cluster under one precision (``price``).

    Legend: ``B`` blocks (``blocks.num_blocks``), ``G`` GPUs of ``cluster``.
    """

    #: The graph cut into B blocks at legal cut points; its cut tensors in the
    #: dtypes the precision's autocast gives them (what a stage sends).
    blocks: BlockGraph
    #: Per block and GPU type: forward+backward seconds per sample and per
    #: micro-batch, parameters, activation and cut bytes.
    costs: BlockCosts
    #: The G GPUs and their links as the planners and the simulator see them;
    #: a GPU type whose profile measured the optimizer step gets the memory
    #: bandwidth at which the objective's optimizer term takes that time.
    devices: DeviceGraph
    #: The precision the costs were measured under, and why it is that one
    #: ("asked for", "auto: T4 has no bf16", ...).
    precision: PrecisionPolicy
    precision_reason: str
    #: Per GPU type, where its block times came from: ``{CLASS_MODEL: 1.0}``
    #: for a type without a measured profile, else the profile's sources
    #: ("exact", "interpolated", ...) as fractions of its node times.
    cost_sources: dict[str, dict[str, float]]
    #: The two micro-batch sizes the measured times were fitted at (per-sample
    #: slope and fixed part); None when no GPU type has a profile.
    profile_batches: tuple[int, int] | None
    #: The cluster and the options it was priced for.
    cluster: Cluster
    options: PlanOptions
    #: The calibration applied (``price(..., calibration=...)``), or None.
    calibration: Calibration | None = None


def resolve_precision(options: PlanOptions, cluster: Cluster) -> tuple[PrecisionPolicy, str]:
    """The plan's precision policy on ``cluster`` and why it is that one
    ("auto: every GPU supports bf16", "auto: T4, V100-16GB have no bf16",
    "asked for").

    Raises:
        PlanOptionsError: bf16-mixed asked for on a cluster with a GPU without
            bfloat16 (the message names the GPU types and the alternatives),
            or a gradient-reduction dtype the precision does not allow.
    """
    specs = [g.spec for g in cluster.gpus]
    if options.precision == "auto":
        name = default_precision(specs)
        missing = sorted({s.type for s in specs if not s.bf16_supported})
        reason = ("every GPU supports bf16" if not missing
                  else f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no bf16")
        return (_policy(name, options.grad_reduce_dtype, why=f" (precision 'auto' chose {name}: {reason})",
                        tf32=options.tf32),
                f"auto: {reason}")
    try:
        check_supported(options.precision, specs)
    except ValueError as exc:
        raise PlanOptionsError(f"PlanOptions.precision on cluster {cluster.name!r}: {exc}") from None
    return _policy(options.precision, options.grad_reduce_dtype, why="", tf32=options.tf32), "asked for"


def options_for_plan(plan, **overrides) -> PlanOptions:
    """The ``PlanOptions`` an exported ``plan.Plan`` was made under, as far as
    pricing and simulation read them: its global batch, schedule, GPU-group
    count, interleave degree, precision, gradient-reduction dtype and bucket size;
    ``overrides`` (``profiles=...``, say) are passed on."""
    fields = dict(global_batch_size=plan.global_batch_size, schedule=plan.schedule,
                  max_stages=plan.num_groups, max_interleave=plan.interleave,
                  precision=plan.precision, grad_reduce_dtype=plan.grad_reduce_dtype, tf32=plan.tf32,
                  bucket_mib=plan.grad_bucket_bytes / 2**20)
    return PlanOptions(**{**fields, **overrides})


def price(captured: CapturedModel, cluster: Cluster, options: PlanOptions, *,
          progress: Callable[[str], None] | None = None, calibration: Calibration | None = None,
          calibration_source: str = "calibration") -> PricedModel:
    """``captured`` priced on ``cluster`` under ``options``' precision.

    The precision is ``resolve_precision``'s. Activations are measured under
    its autocast, and the block graph's tensor specs (so the stages'
    ``recv``/``send`` and the cut bytes) are in the dtypes autocast gives them
    ([Note: saved activations] in ``cost/activations.py``). Types with a
    measured kernel profile (``options.profiles``, loaded once) are priced
    from it; the others by the per-class model with efficiencies learned from
    the measured GPU profiles (``cost/measured.py``); without any profile for
    the cluster's types, by the per-class model alone (``cost/roofline.py``).
    ``progress`` receives one line per decision taken (precision, cost model).
    Times in the returned ``costs`` are seconds, memory bytes (see ``BlockCosts``).
    ``calibration`` (a run's measured corrections, ``cost/calibration.py``
    [Note: calibration]; ``calibration_source``: its file, for messages; None:
    the file ``options.calibration`` names, if any) is applied last, to the
    block times, the optimizer rates and the links.

    Raises:
        TimingsFileError: ``calibration`` is of another precision or cluster.
        PlanOptionsError: the precision does not fit the cluster (see
            ``resolve_precision``).
        ModelCaptureError: the graph has no legal cut (``capture.analyse``).
    """
    say = progress or (lambda msg: None)
    if calibration is None and options.calibration is not None:
        calibration, calibration_source = read_calibration(options.calibration), options.calibration
    policy, why = resolve_precision(options, cluster)
    say(f"precision {policy.describe()} ({why})")
    bg = analyse(captured, max_blocks=options.max_blocks)
    acts = saved_activations_or_estimate(bg, policy)
    cast = bg.with_dtypes(acts.output_dtypes)
    if cast is not bg:
        changed = sorted({f"{t.name} {b.dtype}->{t.dtype}" for ts, bs in zip(cast.cut_tensors, bg.cut_tensors)
                          for t, b in zip(ts, bs) if t.dtype != b.dtype})
        if changed:
            say(f"under {policy.name} autocast these cut tensors change dtype: {', '.join(changed)}")
    bg = cast
    specs = {g.type: g.spec for g in cluster.gpus}
    costs = block_costs(bg, specs, precision=policy, activations=acts)
    profiles = timing = _profiles(options)
    if policy.tf32 and not policy.mixed:
        # The kernel profiles time float32 matmuls as PyTorch runs them by default,
        # TF32 off (``profiling/kernels_main.py`` leaves the flag alone): not what a
        # TF32 plan runs on a GPU that has it. Those types get the class model.
        stale = sorted(t for t in timing.by_type if t in specs and specs[t].tf32_flops_per_s)
        if stale:
            timing = ProfileSet([p for t, p in timing.by_type.items() if t not in stale])
            say(f"TF32 on: the measured profiles of {', '.join(stale)} timed float32 matmuls with TF32 off; "
                f"{'that type is' if len(stale) == 1 else 'those types are'} priced by the class model")
    sources: dict[str, dict[str, float]] = {t: {CLASS_MODEL: 1.0} for t in specs}
    batches = None
    if not any(t in timing for t in specs):
        say(f"cost model: roofline on {', '.join(specs)} ({policy.compute_dtype_name} matmuls; "
            "no measured profile for these types)")
    else:
        measured = [timing.by_type[t].batch_sizes for t in specs
                    if t in timing and timing.by_type[t].batch_sizes]
        batches = options.profile_batches or (
            (min(measured[0]), max(measured[0])) if measured and len(set(measured[0])) > 1
            else (1, max(2, options.global_batch_size // 4)))
        costs, counts = measured_block_costs(bg, specs, timing, batches=batches, base=costs,
                                             compute_dtype=policy.compute_dtype, cast_params=acts.cast_params)
        for t, count in counts.items():
            total = sum(count.values()) or 1
            sources[t] = {k: v / total for k, v in sorted(count.items())}
            say(f"cost model for {t}: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(count.items()))
                + f" of node times (micro-batches {batches[0]} and {batches[1]})")
    devices = _device_graph(cluster, policy, profiles)
    if calibration is not None:
        costs, devices, lines = apply_calibration(costs, devices, calibration, precision=policy.name,
                                                  source=calibration_source)
        for line in lines:
            say(f"calibration {calibration_source}: {line}")
    return PricedModel(blocks=bg, costs=costs, devices=devices,
                       precision=policy, precision_reason=why, cost_sources=sources,
                       profile_batches=batches, cluster=cluster, options=options, calibration=calibration)


def device_graph(cluster: Cluster, options: PlanOptions) -> DeviceGraph:
    """The cluster's device graph under ``options`` (``PricedModel.devices``
    without pricing a model): G GPUs, memory in bytes, bandwidths in bytes/s,
    latencies in seconds; a GPU type whose measured profile timed the
    optimizer step gets the memory bandwidth at which [C-optim] takes that time.

    Raises:
        PlanOptionsError: the precision does not fit the cluster (``resolve_precision``).
    """
    return _device_graph(cluster, resolve_precision(options, cluster)[0], _profiles(options))


def _profiles(options: PlanOptions) -> ProfileSet:
    """The measured kernel profiles ``options.profiles`` names (None: the shipped ones; (): none)."""
    return ProfileSet.load(options.profiles) if options.profiles != () else ProfileSet([])


def _device_graph(cluster: Cluster, policy: PrecisionPolicy, profiles: ProfileSet) -> DeviceGraph:
    """The cluster's device graph; where a GPU type's profile measured the
    optimizer step, its optimizer time comes from that measurement (expressed
    as the memory bandwidth at which the solver's [C-optim] term,
    ``2 * optimizer_bytes_per_param`` per parameter, takes the measured time;
    on a CPU the measurement is the runtime's whole optimizer phase, gradient
    norm and AdamW after a backward: [Note: the measured optimizer step] in
    profiling/kernels_main.py)."""
    dg = cluster.device_graph()
    step_bytes = policy.optimizer_step_bytes_per_param
    bw = list(dg.mem_bw_bytes_per_s)
    for g, t in enumerate(dg.gpu_types):
        prof = profiles.by_type.get(t)
        if prof is not None and prof.optimizer_ns_per_param > 0:
            bw[g] = 2 * step_bytes / (prof.optimizer_ns_per_param * 1e-9)  # [C-optim]: 2 * optim B/param / bw
    return dataclasses.replace(dg, mem_bw_bytes_per_s=tuple(bw))


def simulate_plan(plan, priced: PricedModel, *, p2p: str = "nccl") -> SimResult:
    """One training step of an exported ``plan.Plan`` on ``priced``'s cluster,
    event-simulated (``sim.simulate``) with the plan's stages, GPUs, sample
    shares, micro-batches, interleaving and memory policy (ZeRO-1 shards,
    recomputation). ``p2p``: ``"nccl"`` (the runtime's point-to-point
    program under NCCL's rules), ``"gloo"`` (the same program as Gloo runs
    it: rendezvous messages) or ``"buffered"`` (eager sends).

    Raises:
        ValueError: ``priced`` was priced under another precision than the
            plan trains in (price it with ``options_for_plan(plan)``), or the
            plan does not fit the priced model (its blocks or GPUs).
    """
    _check_precision(plan, priced)
    options = options_for_plan(plan, profiles=priced.options.profiles)
    costs = plan_costs(plan, priced.costs)
    return simulate(costs, priced.devices, options, plan.decision(costs), p2p=p2p)


def evaluate_plan(plan, priced: PricedModel):
    """The objective's ``solve.Evaluation`` of an exported ``plan.Plan`` on
    ``priced`` (as ``simulate_plan``, the objective's closed form instead of
    the event simulation; constraints the plan breaks are in its
    ``violations``, the step is scored all the same).

    Raises:
        ValueError: as ``simulate_plan``.
    """
    from .solve import evaluate

    _check_precision(plan, priced)
    options = options_for_plan(plan, profiles=priced.options.profiles, allow_idle_gpus=True)
    costs = plan_costs(plan, priced.costs)
    return evaluate(costs, priced.devices, options, plan.decision(costs))


def _check_precision(plan, priced: PricedModel) -> None:
    if priced.precision.name != plan.precision or priced.precision.grad_reduce_dtype != plan.grad_reduce_dtype:
        raise ValueError(f"the model was priced under {priced.precision.name} (gradients reduced in "
                         f"{priced.precision.grad_reduce_dtype}) but the plan trains in {plan.precision} "
                         f"({plan.grad_reduce_dtype}): price it with options_for_plan(plan)")


def plan_costs(plan, costs: BlockCosts) -> BlockCosts:
    """``costs`` as ``plan`` keeps its weights: the blocks of a sharded stage
    of two or more GPUs whose ``low_precision_params`` are empty (a plan of
    format 7 or older, or edited) are priced with float32 working weights,
    as the runtime then trains them ([Note: 16-bit working weights])."""
    if not costs.param16_count:
        return costs
    keep = list(costs.param16_count)
    for st in plan.stages:
        if st.memory.zero and len(st.gpus) > 1 and not st.low_precision_params:
            for b in range(*st.blocks):
                keep[b] = 0
    return costs if keep == list(costs.param16_count) else dataclasses.replace(costs, param16_count=tuple(keep))
