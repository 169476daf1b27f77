"""A calibration: the cost model corrected by a run's own measured steps.

[Note: calibration]
``zorse calibrate <run dir>`` (``profiling/calibrate.py``) holds a run's
``timings.jsonl`` ([Note: step timings] in ``runtime/timings.py``) against
what the cost model priced for the run's plan and writes what it found as a
``Calibration`` (``calibration.json``, format ``zorse_fx.calibration``);
``pricing.price(..., calibration=...)`` applies it (``apply_calibration``):

=======================  ======================================================
per GPU ``forward``      its measured forwards / the forwards priced for it
per GPU ``backward``     the same for its backwards (a recomputing stage's
                         re-run forward counted as a forward)
per GPU ``optimizer``    its measured AdamW / the optimizer step priced
``latency_scale``        the gradient norm's world all-reduce measured (the
                         fastest rank's: the others also wait for the last to
                         arrive) / its priced latency rounds: every link's
                         latency is multiplied by it
``bandwidth_scale``      every link's and shared link's time per byte is
                         multiplied by it: fitted (bisection) so that the
                         calibrated objective's step equals the measured one,
                         everything else held; the one fitted number
``step_overhead_*``      the loop's own time per step, measured: rank 0's end
                         of step (through the per-step all-gather) past the
                         latest rank's last phase, less the one latency round
                         [C-control] already prices for that all-gather; plus a
                         token-mean plan's count of its loss tokens (the
                         fastest rank's ``count_s``), which nothing else
                         prices. As whole latency rounds of the run's world
                         (``_rounds``: added to ``BlockCosts.step_control_
                         rounds``, so a plan on other links pays its own:
                         on the box, 3 rounds of a 66 ms link for plans across
                         it, 2 ms on one node) and the rest, a constant
                         (``_s``: ``BlockCosts.step_overhead_s``)
=======================  ======================================================

The block times are corrected per GPU type, by four factors: the forward's
and the backward's per-sample part and fixed part (what grows with a GPU's
samples and what does not: ``BlockCosts.fwd_bwd_s_per_sample`` / ``_fixed``),
fitted over the type's GPUs by least squares of relative errors where their
priced per-sample and fixed times are not proportional (GPUs of the type with
different sample counts or stages), else one factor for both parts. What a
GPU measured beyond its type's fit is its own ``forward`` / ``backward``
factor; one more than ``SAME_SPEED`` off (a straggler: a throttled card, a
noisy neighbour) is priced as a type of its own, ``"<type> (GPU <g>)"``, in
``BlockCosts`` and ``DeviceGraph.gpu_types`` (the plan still records the
cluster's type names). With one GPU per type and sample count, a straggler
cannot be told from its type's per-sample cost: ``--rebalance`` compares a
run against the calibration it was planned with. A GPU type the runs did not
use is scaled by the measured types' geometric mean factors, and a GPU they
did not use by the measured GPUs' mean optimizer factor: the cluster as a
whole faster or slower than priced is the best guess there is (left as
priced, a type a CPU run never measured would look 10-100x faster than the
measured ones, and every re-plan would move to it).

What a calibration transfers: the same cluster, model, precision and sequence
length, other cuts, shares and micro-batch sizes (the factors are ratios of
whole forwards and backwards, applied block by block: exact where the
priced per-block proportions hold, an approximation for a cut that moves
compute between blocks the profile prices with different errors), other
global batches. What it cannot: another precision (the kernels differ; the
file records the run's and ``apply_calibration`` refuses another), another
model (other blocks), another cluster (its GPUs are checked by index, node
and type), a plan using links the run did not (their scales are the run's
links' average: ``bandwidth_scale`` and ``latency_scale`` are one number each
for every link, fitted where the run's traffic went). On a CPU run the
"GPUs" are CPU processes: the calibration then describes the CPU, which is
what the runtime's tests and ``bench/`` hold it to.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..errors import TimingsFileError
from ..file_schema import FileFormat
from ..ir.costs import FORWARD_SHARE, BlockCosts
from ..ir.devices import DeviceGraph, SharedLink

__all__ = ["Calibration", "RunCalibration", "TypeCalibration", "GPUCalibration", "CALIBRATION_FILE", "SAME_SPEED",
           "apply_calibration", "read_calibration", "write_calibration", "calibrated_type"]

FORMAT, VERSION = "zorse_fx.calibration", 1
#: GPUs of one type whose factors are within this ratio of the type's median are priced alike.
SAME_SPEED = 1.10

Factor = Annotated[float, Meta(gt=0.0, lt=1e6, description="measured / priced")]
Seconds = Annotated[float, Meta(ge=0.0, description="seconds")]


class TypeCalibration(msgspec.Struct, forbid_unknown_fields=True):
    """One GPU type of the run: factors on its priced block times, per pass and part."""

    gpu_type: str
    forward_per_sample: Factor
    forward_fixed: Factor
    backward_per_sample: Factor
    backward_fixed: Factor
    fit: Annotated[str, Meta(description="how the factors were found")] = ""


class GPUCalibration(msgspec.Struct, forbid_unknown_fields=True):
    """One GPU in one run: what it measured and was priced per step, and its own factors
    over its type's (``forward`` / ``backward``: 1 where the type's factors explain it)."""

    run: Annotated[int, Meta(ge=0, description="the run it was measured in: an index of 'runs'")]
    gpu: Annotated[int, Meta(ge=0, description="the GPU's index in the cluster file")]
    node: str
    gpu_type: str
    samples: Annotated[int, Meta(ge=1, description="the samples it takes of every micro-batch")]
    forward: Factor
    backward: Factor
    optimizer: Factor
    forward_measured_s: Seconds
    forward_priced_s: Seconds
    backward_measured_s: Seconds
    backward_priced_s: Seconds
    optimizer_measured_s: Seconds
    optimizer_priced_s: Seconds


class RunCalibration(msgspec.Struct, forbid_unknown_fields=True):
    """One run the calibration measured, and its step before and after."""

    run_dir: str
    run_id: str
    plan_hash: str
    steps: Annotated[list[int], Meta(min_length=1, description="the steps whose timings were used")]
    num_microbatches: Annotated[int, Meta(ge=1)]
    measured_step_s: Seconds
    objective_step_s: Annotated[float, Meta(ge=0.0, description="the objective's step before calibration")]
    calibrated_objective_step_s: Annotated[float, Meta(ge=0.0, description="the objective's step after it")]
    simulated_step_s: Annotated[float, Meta(ge=0.0, description="the simulator's step before calibration")]
    calibrated_simulated_step_s: Annotated[float, Meta(ge=0.0, description="the simulator's step after it")]


class Calibration(msgspec.Struct, forbid_unknown_fields=True):
    """What ``zorse calibrate`` measured of one or more runs on one cluster ([Note: calibration])."""

    format: Literal["zorse_fx.calibration"]
    version: Literal[1]
    cluster: Annotated[str, Meta(description="the cluster's name (its file's 'name')")]
    precision: Annotated[str, Meta(description="the precision the runs trained in")]
    clock: Literal["perf_counter", "cuda_events"]
    runs: Annotated[list[RunCalibration], Meta(min_length=1)]
    types: Annotated[list[TypeCalibration], Meta(min_length=1)]
    gpus: Annotated[list[GPUCalibration], Meta(min_length=1)]
    latency_scale: Factor
    bandwidth_scale: Factor
    bandwidth_fit: Annotated[str, Meta(description="how bandwidth_scale was found")]
    step_overhead_s: Seconds
    step_overhead_rounds: Annotated[int, Meta(ge=0, le=10_000, description="latency rounds of the world per step "
                                                                           "the loop takes beyond [C-control]'s")] = 0


CALIBRATION_FILE = FileFormat(name=FORMAT, what="calibration", doc=Calibration, versions=(VERSION,),
                              remake="make it again with `zorse calibrate <run dir>`", error=TimingsFileError)


def read_calibration(path: str | Path) -> Calibration:
    """The calibration file at ``path``, checked: every field's type and range, and that each
    ``gpus[k].run`` is an index of ``runs`` and each ``gpus[k].gpu_type`` has its ``types`` entry.

    Raises:
        TimingsFileError: naming the file, the field and the value."""
    cal = CALIBRATION_FILE.read(path)[1]
    types = {t.gpu_type for t in cal.types}
    for k, g in enumerate(cal.gpus):
        if g.run >= len(cal.runs):
            raise CALIBRATION_FILE.field_error(str(path), ["gpus", k, "run"], g.run,
                                               f"an index of 'runs' (0..{len(cal.runs) - 1})")
        if g.gpu_type not in types:
            raise CALIBRATION_FILE.field_error(str(path), ["gpus", k, "gpu_type"], g.gpu_type,
                                               f"a type of 'types' ({', '.join(sorted(types))})")
    return cal


def write_calibration(cal: Calibration, path: str | Path) -> Path:
    """Write ``cal`` to ``path`` (JSON, indented; parent directories made). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(cal), indent=1) + b"\n")
    return path


def calibrated_type(gpu_type: str, gpu: int) -> str:
    """The type name a straggler GPU is priced under (``"T4 (GPU 3)"``)."""
    return f"{gpu_type} (GPU {gpu})"


def _scaled(costs: BlockCosts, key: str, new_key: str, t: TypeCalibration, residual: tuple[float, float] = (1, 1)
            ) -> dict[str, dict]:
    """The per-type time tables of ``key`` corrected by ``t`` (and a GPU's own ``residual`` forward and
    backward factors), under ``new_key``: forward and backward parts, per sample and fixed, each by its factor."""
    out = {}
    for whole_name, part_name, f_f, b_f in (
            ("fwd_bwd_s_per_sample", "fwd_s_per_sample", t.forward_per_sample, t.backward_per_sample),
            ("fwd_bwd_s_fixed", "fwd_s_fixed", t.forward_fixed, t.backward_fixed)):
        whole = getattr(costs, whole_name).get(key)
        if whole is None:
            continue
        f_f, b_f = f_f * residual[0], b_f * residual[1]
        part = getattr(costs, part_name).get(key) or tuple(FORWARD_SHARE * x for x in whole)
        fwd = tuple(f_f * f for f in part)
        out.setdefault(whole_name, {})[new_key] = tuple(f2 + b_f * (x - f) for f2, x, f in zip(fwd, whole, part))
        out.setdefault(part_name, {})[new_key] = fwd
    return out


def apply_calibration(costs: BlockCosts, devices: DeviceGraph, cal: Calibration, *, precision: str,
                      source: str = "calibration") -> tuple[BlockCosts, DeviceGraph, list[str]]:
    """``costs`` and ``devices`` corrected by ``cal`` ([Note: calibration]),
    and one line per decision taken (for the progress output).

    Raises:
        TimingsFileError: ``cal`` was measured in another precision than
            ``precision``, or names a GPU the device graph does not have at
            its index (another type or node), naming ``source`` and the field.
    """
    if cal.precision != precision:
        raise TimingsFileError(f"{source}: field 'precision' is {cal.precision!r} but the model is priced in "
                               f"{precision!r}: a calibration holds for the precision its run trained in; calibrate "
                               f"a run in {precision}", path=source, field="'precision'", value=cal.precision)
    types = devices.gpu_types
    for k, g in enumerate(cal.gpus):
        if g.gpu >= len(types) or types[g.gpu] != g.gpu_type or (
                devices.node_names and devices.node_names[g.gpu] != g.node):
            node = devices.node_names[g.gpu] if devices.node_names and g.gpu < len(types) else "?"
            there = (f"the cluster has {types[g.gpu]} on node {node}" if g.gpu < len(types)
                     else f"the cluster has {len(types)} GPUs")
            raise TimingsFileError(f"{source}: field gpus[{k}] is GPU {g.gpu} ({g.gpu_type} on node {g.node}) but "
                                   f"{there}: a calibration holds for the cluster its run trained on",
                                   path=source, field=f"gpus[{k}]", value=g.gpu)
    lines = []
    gpu_types = list(types)
    tables: dict[str, dict] = {name: dict(getattr(costs, name)) for name in
                               ("fwd_bwd_s_per_sample", "fwd_s_per_sample", "fwd_bwd_s_fixed", "fwd_s_fixed")}
    for t in cal.types:
        for name, table in _scaled(costs, t.gpu_type, t.gpu_type, t).items():
            tables[name].update(table)
        lines.append(f"{t.gpu_type}: forward x{t.forward_per_sample:.3g} per sample, x{t.forward_fixed:.3g} fixed; "
                     f"backward x{t.backward_per_sample:.3g} per sample, x{t.backward_fixed:.3g} fixed ({t.fit})")
    of_type = {t.gpu_type: t for t in cal.types}
    # A type the runs did not use: the measured types' geometric mean (the cluster as a whole faster or slower
    # than priced; on one CPU every "GPU" is the same processor).
    unmeasured = sorted(set(types) - set(of_type) - {""})
    if unmeasured:
        mean = TypeCalibration(gpu_type="", **{f: statistics.geometric_mean(getattr(t, f) for t in cal.types) for f in (
            "forward_per_sample", "forward_fixed", "backward_per_sample", "backward_fixed")})
        for t in unmeasured:
            for name, table in _scaled(costs, t, t, mean).items():
                tables[name].update(table)
        lines.append(f"{', '.join(unmeasured)}: not measured, scaled by the measured types' geometric mean "
                     f"(forward x{mean.forward_per_sample:.3g} per sample, backward x{mean.backward_per_sample:.3g})")
    latest = {g.gpu: g for g in sorted(cal.gpus, key=lambda g: g.run)}  # a GPU in several runs: the last run's
    for g in latest.values():
        if max(g.forward, 1 / g.forward, g.backward, 1 / g.backward) <= SAME_SPEED or g.gpu_type not in of_type:
            continue
        key = calibrated_type(g.gpu_type, g.gpu)
        for name, table in _scaled(costs, g.gpu_type, key, of_type[g.gpu_type], (g.forward, g.backward)).items():
            tables[name].update(table)
        gpu_types[g.gpu] = key
        lines.append(f"GPU {g.gpu} ({g.gpu_type}) priced on its own: its forward x{g.forward:.3g} and backward "
                     f"x{g.backward:.3g} its type's (more than {SAME_SPEED:g}x off)")
    mem_bw = list(devices.mem_bw_bytes_per_s)
    for g in latest.values():
        mem_bw[g.gpu] /= g.optimizer
    opt_mean = statistics.geometric_mean(g.optimizer for g in latest.values())
    for g in set(range(len(types))) - set(latest):  # a GPU the runs did not use: the measured GPUs' mean
        mem_bw[g] /= opt_mean
    lat, bw = cal.latency_scale, cal.bandwidth_scale
    devices = dataclasses.replace(
        devices, gpu_types=tuple(gpu_types), mem_bw_bytes_per_s=tuple(mem_bw),
        link_latency_s=tuple(tuple(x * lat for x in row) for row in devices.link_latency_s),
        link_bw_bytes_per_s=tuple(tuple(x / bw for x in row) for row in devices.link_bw_bytes_per_s),
        shared_links=tuple(SharedLink(name=s.name, gpus_a=s.gpus_a, gpus_b=s.gpus_b,
                                      bandwidth_bytes_per_s=s.bandwidth_bytes_per_s / bw)
                           for s in devices.shared_links))
    costs = dataclasses.replace(costs, **tables, step_overhead_s=cal.step_overhead_s,
                                step_control_rounds=costs.step_control_rounds + cal.step_overhead_rounds)
    lines.append(f"links: latency x{lat:.3g}, time per byte x{bw:.3g}; loop overhead "
                 f"{cal.step_overhead_rounds} latency round(s) of the world + {cal.step_overhead_s * 1e3:.2f} ms "
                 f"per step")
    return costs, devices, lines
