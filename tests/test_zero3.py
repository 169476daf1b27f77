"""Sharded parameters, ZeRO-3 ([Note: sharded parameters] in
``runtime/param_shard.py``): each GPU keeps its ZeRO-1 range of the stage's
working weights, every block's gathered before its forward and again for its
backward (``UNITS`` and the ``zorse_gather`` / ``zorse_release`` calls of the
generated source), ZeRO-2 beneath. Equal to single-process training (losses,
gradients, parameters after several steps) on Gloo with NCCL's semantics,
with unequal shards and unequal sample shares together, a tied embedding,
clipping, fp32 and bf16 with 16-bit working weights, recomputation and
interleaving with M not a multiple of the group count; checkpoints move
between ZeRO-3 and ZeRO-1. Tolerances: ``conftest.TOLERANCES``; ZeRO-3 adds
no arithmetic (gathers copy values), so ZeRO-2's tolerances hold.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (fixed_plan, gpt3x64, gpt4x64, train_and_compare, with_low_precision, with_memory_policy,
                      with_param_sharding)
from zorse_fx.errors import PlanFileError
from zorse_fx.plan import Plan
from test_zero2 import LR, SMALL_BUCKETS, WEIGHT_DECAY, _two_stage_plan


def test_generated_source_gathers_each_unit_around_its_reads():
    """Codegen: ``UNITS`` lists every trainable parameter the forward reads
    once, grouped by block, and ``forward`` calls ``zorse_gather(u)`` before
    and ``zorse_release(u)`` after each unit's reads, in unit order."""
    import re

    captured = gpt3x64()
    plan = _two_stage_plan(captured)
    for s, source in zip(plan.stages, plan.sources, strict=True):
        ns: dict = {}
        exec(compile(source, s.source_file, "exec"), ns)  # noqa: S102 - generated here
        units = ns[f"Stage{s.index}"].UNITS
        flats = [f for u in units for f in u]
        assert sorted(flats) == sorted(s.params) and len(units) >= 2
        body = source[source.index("def forward"):]
        calls = re.findall(r"self\.zorse_(gather|release)\((\d+)\)", body)
        assert sorted(calls) == sorted((kind, str(u)) for u in range(len(units)) for kind in ("gather", "release"))
        assert [u for kind, u in calls if kind == "gather"] == [str(u) for u in range(len(units))]
        for u, flats_u in enumerate(units):
            g, r = body.index(f"self.zorse_gather({u})"), body.index(f"self.zorse_release({u})")
            for flat in flats_u:  # every read of the unit's locals lies between its gather and its release
                local = re.search(rf"^\s*(\w+) = self\.{flat}\s*$", body, re.M).group(1)
                reads = [m.start() for m in re.finditer(rf"(?<!self\.)\b{local}\b", body)
                         if not body[m.start():].startswith(f"{local} = self.")]
                assert reads and all(g < k < r for k in reads), (flat, g, r, reads)


def test_fp32_zero3_unequal_shards_and_shares_with_clipping(lee_bytes, tmp_path):
    """fp32, M = 3, clipping at 0.5; stage 1 on two GPUs taking 1:2 of each
    micro-batch with 3:1 shards, the tied embedding (stages 0 and 1) on the
    all-reduce path beside the sharded gradients: equal to one process."""
    captured = gpt3x64()
    plan = with_param_sharding(_two_stage_plan(captured))
    assert plan.stages[1].param_sharded and plan.stages[1].grad_sharded and not plan.stages[0].param_sharded
    assert "ZeRO-3" in plan.table()
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                     extra=("--clip-grad-norm", "0.5"), ref_kwargs={"clip": 0.5})
    owned = {r: sum(b["owned_elements"] for b in summaries[r]["buffers"]) for r in (1, 2)}
    assert owned[1] > 2 * owned[2]
    n = sum(p.numel() for p in captured.graph_module.parameters())
    for r in (1, 2):
        z3 = summaries[r]["zero3"]
        # Between steps nothing is gathered: the GPU keeps its float32 shard of the weights only.
        assert z3["gathered_bytes"] == 0 and z3["owned_weight_bytes"] == 4 * owned[r] < 4 * n
        # Each unit gathered for every micro-batch's forward and again for its backward: 2 x M x steps.
        assert z3["units"] >= 4 and z3["gathers"] >= 2 * 3 * 3 * z3["units"], z3
    assert summaries[0]["zero3"] is None


def test_bf16_zero3_with_sixteen_bit_working_weights_and_recomputation(lee_bytes, tmp_path):
    """bf16-mixed, 16-bit working weights, the ZeRO-3 stage recomputing (its
    first forward under no_grad gathers and frees; the recomputed one records
    the saved weights that the backward re-gathers)."""
    captured = gpt3x64()
    plan = with_param_sharding(with_low_precision(_two_stage_plan(captured), captured))
    plan = with_memory_policy(plan, sharded={1}, recompute={1}, shard_bytes={1: (3 * 2**20, 2**20)})
    plan = with_param_sharding(with_low_precision(plan, captured))
    assert plan.stages[1].recompute and plan.stages[1].param_sharded and plan.stages[1].low_precision_params
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_bf16_zero3_interleaved_three_microbatches(lee_bytes, tmp_path):
    """Interleaved, P = 2 groups, v = 2, M = 3 (not a multiple of P); group 0
    (2 GPUs, 2:1 samples) runs stages 0 and 2 under ZeRO-3 with shards 1:2
    and 3:1: two ZeRO-3 stages on one rank, their gathers and reduce-scatters
    on one group, in one order on both GPUs."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                      global_batch_size=9, interleave=2, bucket_mib=SMALL_BUCKETS)
    plan = with_memory_policy(plan, sharded={0, 2}, shard_bytes={0: (2**20, 2 * 2**20), 2: (3 * 2**20, 2**20)})
    plan = with_param_sharding(with_low_precision(plan, captured))
    assert [s.param_sharded for s in plan.stages] == [True, False, True, False]
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_param_sharded_needs_sharded_gradients():
    """The plan file: ``param_sharded`` without ``grad_sharded`` is refused
    naming the field, the value and the fix; a version-9 file reads with it off."""
    captured = gpt3x64()
    plan = with_param_sharding(_two_stage_plan(captured))
    bad = plan.to_dict()
    bad["stages"][1]["grad_sharded"] = False
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.param_sharded is true, but sharded parameters \(ZeRO-3\) "
                                            r"need sharded gradients \(grad_sharded is False\); set grad_sharded to "
                                            r"true"):
        Plan.from_dict(bad)
    d = plan.to_dict()
    assert Plan.from_dict(d).stages[1].param_sharded
    d["version"] = 9
    for s in d["stages"]:
        del s["param_sharded"]
    assert not any(s.param_sharded for s in Plan.from_dict(d).stages)


def test_checkpoints_move_between_zero1_and_zero3(lee_bytes, tmp_path):
    """fp32, 4 ranks, both stages sharded (2:1 and 3:1). Steps 1-2 under
    ZeRO-3, step 3 resumed under ZeRO-1, step 4 under ZeRO-3 again: equal to 4
    uninterrupted ZeRO-1 steps. A ZeRO-3 checkpoint holds each GPU's owned
    ranges of the weights, never a whole stage."""
    from conftest import assert_resume_across_layouts
    from test_training_loop import _plan_a4

    captured = gpt3x64()
    z1 = with_memory_policy(_plan_a4(captured), sharded={0, 1}, shard_bytes={0: (2**20, 2**20),
                                                                             1: (3 * 2**20, 2**20)})
    z3 = with_param_sharding(z1)
    assert all(s.param_sharded for s in z3.stages)
    assert_resume_across_layouts(captured, lee_bytes, tmp_path, z1, z3)

