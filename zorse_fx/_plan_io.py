"""plan.json on disk, for ``plan.py``'s ``Plan``: the JSON form it writes
(``plan_dict``, behind ``Plan.to_dict`` / ``to_json`` / ``export``) and the
files ``Plan.load`` reads (``read_plan_files``: plan.json parsed and checked
against its schema, then every stage source beside it).

Split from ``plan.py``, which keeps the dataclasses, the rules tying their
fields together (``Plan.__post_init__``) and the building of a ``Plan`` from
a decoded file (``Plan.from_dict``). The format itself (fields, versions,
stage-source hashes) is described in ``plan.py``'s module docstring; the
schema and its upgrades of older versions are in ``plan_schema.py``, the
stage-source checks in ``stage_sources.py``. Errors are ``PlanFileError``
naming the file, the field path and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PlanFileError
from .plan_schema import PlanDoc, decode
from .stage_sources import check_source_name

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["plan_dict", "read_plan_files"]


def plan_dict(plan: Plan) -> dict:
    """The JSON-ready dict of ``plan`` (plan.json's content, format
    ``plan.version``): every field, plus ``compute_dtype`` and each stage's
    ``source_sha256`` (``Plan.source_hashes``; None where unknown)."""
    hashes = plan.source_hashes()
    return {
        "format": "zorse_fx.plan",
        "version": plan.version,
        "cluster_name": plan.cluster_name,
        "model_name": plan.model_name,
        "input_names": list(plan.input_names),
        "seq_len": plan.seq_len,
        "label_mode": plan.label_mode,
        "global_batch_size": plan.global_batch_size,
        "microbatch_size": plan.microbatch_size,
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "interleave": plan.interleave,
        "precision": plan.precision,
        "grad_reduce_dtype": plan.grad_reduce_dtype,
        "compute_dtype": plan.compute_dtype,
        "predicted_step_time_s": plan.predicted_step_time_s,
        "solver": {
            "planner": plan.solver.planner,
            "status": plan.solver.status,
            "objective_s": plan.solver.objective_s,
            "best_bound_s": plan.solver.best_bound_s,
            "optimality_gap": plan.solver.optimality_gap,
            "wall_s": plan.solver.wall_s,
            "time_limit_s": plan.solver.time_limit_s,
            "solver_budget": plan.solver.solver_budget,
            "wall_clock_stops": plan.solver.wall_clock_stops,
            "candidates": list(plan.solver.candidates),
            "simulated_step_time_s": plan.solver.simulated_step_time_s,
            "simulated_max_memory_fraction": plan.solver.simulated_max_memory_fraction,
            "simulated_bubble_fraction": plan.solver.simulated_bubble_fraction,
        },
        "stages": [
            {
                "index": s.index,
                "blocks": list(s.blocks),
                "label": s.label,
                "gpus": [
                    {
                        "rank": g.rank,
                        "gpu": g.gpu,
                        "node": g.node,
                        "gpu_type": g.gpu_type,
                        "samples_per_microbatch": g.samples_per_microbatch,
                        "predicted_memory_bytes": g.predicted_memory_bytes,
                        "memory_capacity_bytes": g.memory_capacity_bytes,
                        "state_shard_bytes": g.state_shard_bytes,
                    }
                    for g in s.gpus
                ],
                "input_names": list(s.input_names),
                "recv": [t.to_dict() for t in s.recv],
                "send": [t.to_dict() for t in s.send],
                "params": dict(s.params),
                "consts": dict(s.consts),
                "num_parameters": s.num_parameters,
                "source_file": s.source_file,
                "source_sha256": hashes[s.index],
                "predicted_time_s": s.predicted_time_s,
                "predicted_allreduce_s": s.predicted_allreduce_s,
                "sharded": s.sharded,
                "recompute": s.recompute,
            }
            for s in plan.stages
        ],
    }


def read_plan_files(path: str | Path) -> tuple[Path, dict, PlanDoc, tuple[str, ...]]:
    """The files of the plan at ``path`` (``plan.json`` or a directory
    holding it): ``(plan.json's path, its parsed dict, that dict checked by
    ``plan_schema.decode``, the text of each stage's source file)``.

    The schema is checked before any stage file is read; each ``source_file``
    must be a plain name (``stage_sources.check_source_name``) of a file
    beside plan.json. The sources' sha256 are not checked here (``Plan.load``
    checks them). Raises PlanFileError for a missing plan.json, invalid JSON,
    a schema error or a missing stage file, naming the file and the field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "plan.json"
    if not path.exists():
        raise PlanFileError(f"{path}: no such plan file; create one with `zorse plan`")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    doc = decode(d, str(path))
    sources = []
    for i, s in enumerate(doc.stages):
        name = check_source_name(s.source_file, i, str(path))
        src = path.parent / name
        if not src.is_file():
            raise PlanFileError(f"{path}: stage {i} source {src} (field stages[{i}].source_file) is missing; "
                                f"re-export the plan with `zorse plan`")
        sources.append(src.read_text())
    return path, d, doc, tuple(sources)
