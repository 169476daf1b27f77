"""Mixed precision as a plan choice ([Note: mixed precision] in
``zorse_fx/precision.py``): "auto" resolution per cluster, errors for a
precision a GPU cannot run, the bytes per parameter the cost model charges,
cut tensors in their autocast dtype, and the precision in plan.json (round
trip, older versions, invalid values) and in the plan table."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn as nn
from conftest import CLUSTERS, small_gpt

from zorse_fx.capture import analyse, capture
from zorse_fx.cli import main as zorse_main
from zorse_fx.cluster import Cluster
from zorse_fx.cost.roofline import block_costs, measure_saved_activations
from zorse_fx.errors import PlanFileError, PlanOptionsError
from zorse_fx.ir.tensor import TensorSpec
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.plan import PLAN_FORMAT_VERSION, Plan
from zorse_fx.planner import PlanOptions, plan_fixed, resolve_precision
from zorse_fx.pricing import price
from zorse_fx.precision import precision_policy
from zorse_fx.solve import Decision

T = 16
#: A100-40GB x 8 + H100 x 4: every GPU computes in bfloat16.
AMPERE = CLUSTERS / "zorse_a.yaml"
#: P100 + T4 / V100 + T4: none does.
DEMO = CLUSTERS / "demo.yaml"


@pytest.fixture(scope="module")
def gpt():
    return small_gpt(seq=T)


# -- "auto" and the errors ----------------------------------------------------

@pytest.mark.parametrize(("cluster", "name", "why"), [
    (DEMO, "fp16-mixed", "auto: P100-16GB, T4, V100-16GB have no bf16"),
    (CLUSTERS / "small_hetero.yaml", "fp16-mixed", "auto: T4 has no bf16"),
    (AMPERE, "bf16-mixed", "auto: every GPU supports bf16"),
    (CLUSTERS / "flashflex.yaml", "bf16-mixed", "auto: every GPU supports bf16"),
])
def test_auto_resolves_per_cluster(cluster, name, why):
    policy, reason = resolve_precision(PlanOptions(global_batch_size=8), Cluster.from_yaml(cluster))
    assert (policy.name, policy.grad_reduce_dtype, reason) == (name, "float32", why)


def test_explicit_precision_is_kept():
    demo = Cluster.from_yaml(DEMO)
    for name in ("fp32", "fp16-mixed"):
        policy, reason = resolve_precision(PlanOptions(global_batch_size=8, precision=name), demo)
        assert (policy.name, reason) == (name, "asked for")
    policy, _ = resolve_precision(PlanOptions(global_batch_size=8, precision="bf16-mixed",
                                              grad_reduce_dtype="bfloat16"), Cluster.from_yaml(AMPERE))
    assert (policy.name, policy.grad_reduce_dtype) == ("bf16-mixed", "bfloat16")


def test_bf16_on_pre_ampere_gpus_is_refused(gpt):
    options = PlanOptions(global_batch_size=8, precision="bf16-mixed")
    expected = ("PlanOptions.precision on cluster 'demo-pascal-volta-turing': precision 'bf16-mixed' needs bfloat16 on "
                "every GPU of the plan, but P100-16GB, T4, V100-16GB have none (pre-Ampere); use precision "
                "'fp16-mixed' (loss scaling) or 'fp32'")
    demo = Cluster.from_yaml(DEMO)
    assert demo.name == "demo-pascal-volta-turing"
    with pytest.raises(PlanOptionsError) as e:
        resolve_precision(options, demo)
    assert str(e.value) == expected
    assert isinstance(e.value, ValueError)  # a user error
    with pytest.raises(PlanOptionsError, match=r"but T4 has none \(pre-Ampere\)"):
        plan_fixed(gpt, Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"), options,
                   Decision(stage_blocks=((0, 1),), stage_gpus=((0,),), samples_per_microbatch=((4,),),
                            num_microbatches=2))


@pytest.mark.parametrize(("kw", "message"), [
    (dict(precision="bf16"), "PlanOptions.precision='bf16': use 'auto' or one of 'fp32', 'bf16-mixed', 'fp16-mixed'"),
    (dict(grad_reduce_dtype="float16"),
     "PlanOptions.grad_reduce_dtype='float16': use None (the precision's default) or one of 'float32', 'bfloat16'"),
    (dict(precision="fp16-mixed", grad_reduce_dtype="bfloat16"),
     "PlanOptions.grad_reduce_dtype='bfloat16': precision 'fp16-mixed' reduces gradients in float32, not "
     "'bfloat16'; leave grad_reduce_dtype unset (float32) or ask for precision 'bf16-mixed'"),
])
def test_invalid_options_are_named(kw, message):
    with pytest.raises(PlanOptionsError) as e:
        PlanOptions(global_batch_size=8, **kw)
    assert str(e.value) == message


def test_auto_with_bfloat16_reduction_names_what_auto_chose():
    options = PlanOptions(global_batch_size=8, grad_reduce_dtype="bfloat16")
    with pytest.raises(PlanOptionsError, match=r"reduces gradients in float32, not 'bfloat16' \(precision 'auto' "
                                               r"chose fp16-mixed: T4 has no bf16\)"):
        resolve_precision(options, Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"))
    assert resolve_precision(options, Cluster.from_yaml(AMPERE))[0].grad_reduce_dtype == "bfloat16"


def test_cli_refuses_bf16_on_t4(tmp_path, capsys):
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                       "--global-batch-size", "8", "--seq-len", "16", "--precision", "bf16-mixed",
                       "-o", str(tmp_path / "plan")]) == 1
    err = capsys.readouterr().err
    assert re.match(r"^zorse: PlanOptions.precision on cluster 'small_hetero'.*T4 has none", err), err
    assert "Traceback" not in err
    assert not (tmp_path / "plan").exists()


# -- what the cost model charges ----------------------------------------------

@pytest.mark.parametrize(("name", "reduce", "expected"), [
    # (state, all-reduce, all-gather, shardable) bytes per parameter
    ("fp32", None, (16, 4, 4, 8)),
    ("bf16-mixed", None, (18, 4, 4, 8)),
    ("bf16-mixed", "bfloat16", (20, 2, 4, 8)),
    ("fp16-mixed", None, (18, 4, 4, 8)),
])
def test_block_costs_bytes_per_param(gpt, name, reduce, expected):
    bg = analyse(gpt)
    costs = block_costs(bg, {}, precision=precision_policy(name, reduce))
    assert (costs.state_bytes_per_param, costs.grad_bytes_per_param, costs.param_bytes_per_param,
            costs.shardable_bytes_per_param) == expected


def test_matmuls_priced_at_the_compute_dtype_peak():
    """On an A100 the bf16 tensor peak (312 TFLOP/s) is 16x the fp32 one
    (19.5): the time of the matmuls falls accordingly (a GPT wide and long
    enough for its matmuls to be compute-bound in float32). The A100 is
    priced by the GPU class model (``cost/gpu_model.py``): bf16 matmuls at the
    fitted sustained rate of its class, fp32 ones at ``MATMUL_EFFICIENCY`` of
    the fp32 peak (TF32 is off by default in PyTorch)."""
    from zorse_fx.cluster import gpu_spec
    from zorse_fx.cost import gpu_model
    from zorse_fx.cost.roofline import (
        MATMUL_EFFICIENCY,
        class_block_time,
        grad_work_bytes,
        graph_chains,
        node_costs,
        weight_traffic_bytes,
    )

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 256))
    bg = analyse(capture(GPT(GPTConfig(n_layer=1, n_embd=256, block_size=256)), (ids, ids)))
    a100 = gpu_spec("A100-40GB")
    assert gpu_model.sustained_matmul_flops_per_s(a100, torch.float32, MATMUL_EFFICIENCY) == MATMUL_EFFICIENCY * 19.5e12
    assert gpu_model.sustained_matmul_flops_per_s(a100, torch.bfloat16, MATMUL_EFFICIENCY) == pytest.approx(
        gpu_model.ARCH_EFFICIENCY["ampere-ga100"] * 312e12)
    fp32 = block_costs(bg, {"A100-40GB": a100}, precision=precision_policy("fp32"))
    bf16 = block_costs(bg, {"A100-40GB": a100}, precision=precision_policy("bf16-mixed"))
    policy = precision_policy("bf16-mixed")
    for prec, got, costs in ((precision_policy("fp32"), fp32, node_costs(bg)),
                             (policy, bf16, node_costs(bg, measure_saved_activations(bg, policy), policy))):
        accumulate, casts = grad_work_bytes(bg, prec, measure_saved_activations(bg, prec).cast_params)
        state, trainable = bg.captured.state(), bg.captured.trainable()
        for b in range(bg.num_blocks):
            f, bw, ff, fb = class_block_time(bg, costs, b, graph_chains(bg, costs)[b],
                                              weight_traffic_bytes(bg, b, prec), a100, prec)
            assert got.fwd_bwd_s_per_sample["A100-40GB"][b] == pytest.approx(f + bw, rel=1e-12)
            # + the runtime's gradient work beyond the class model's 2 x 4 B per parameter ([Note: the
            # runtime's gradient work]): the add's third 4 B, and under bf16-mixed the 2 + 4 B gradient casts
            charged = sum(8 * state[a].numel() for a in bg.block_attrs[b] if a in trainable)
            grad_s = (accumulate[b] + casts[b] - charged) / (a100.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY)
            assert grad_s > 0 or not charged
            assert got.fwd_bwd_s_fixed["A100-40GB"][b] == pytest.approx(ff + fb + grad_s, rel=1e-12)
        assert (sum(casts) > 0) == prec.mixed
    assert sum(bf16.fwd_bwd_s_per_sample["A100-40GB"]) < 0.5 * sum(fp32.fwd_bwd_s_per_sample["A100-40GB"])


def test_node_bytes_in_their_autocast_dtypes(gpt):
    """Under bf16-mixed a Linear reads a bfloat16 input, weight and bias
    (autocast's casts) and writes bfloat16, GELU works on bfloat16, and the
    LayerNorm on the float32 residual stream stays float32."""
    from zorse_fx.cost.roofline import node_costs

    bg = analyse(gpt)
    policy = precision_policy("bf16-mixed")
    acts = measure_saved_activations(bg, policy)
    fp32, bf16 = node_costs(bg), node_costs(bg, acts, policy)
    nodes = {n.name: n for n in bg.graph.nodes}
    kinds = {name: getattr(nodes[name].target, "__name__", str(nodes[name].target)) for name in bg.act_order}
    linear = next(n for n in bg.act_order if kinds[n] == "linear")
    gelu = next(n for n in bg.act_order if kinds[n] == "gelu")
    norm = next(n for n in bg.act_order if kinds[n] == "layer_norm")
    assert (acts.output_dtypes[linear], acts.output_dtypes[gelu], acts.output_dtypes[norm]) == \
        ("bfloat16", "bfloat16", "float32")
    for name in (linear, gelu):
        assert 2 * bf16[name].bytes == fp32[name].bytes > 0 and bf16[name].flops == fp32[name].flops
    assert bf16[norm] == fp32[norm]


class _Bottleneck(nn.Module):
    """Linear layers without a residual stream: the narrowest tensor, where
    the one minimal cut falls, is a matmul output, which autocast makes 16-bit."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 8)
        self.c = nn.Linear(8, 64)

    def forward(self, x, y):
        h = torch.relu(self.a(x))  # (N, 64)
        z = self.b(h)  # (N, 8): the cut
        return ((self.c(z).float() - y) ** 2).mean()


def test_cut_tensors_travel_in_their_autocast_dtype():
    """A cut after a matmul: under bf16-mixed the crossing tensor is bfloat16,
    so the plan's send/recv specs (the wire format) and the cut bytes say so."""
    torch.manual_seed(0)
    captured = capture(_Bottleneck(), (torch.randn(2, 16), torch.randn(2, 64)), method="fx")
    ampere = Cluster.from_yaml(AMPERE)
    p32 = price(captured, ampere, PlanOptions(global_batch_size=4, precision="fp32", profiles=()))
    p16 = price(captured, ampere, PlanOptions(global_batch_size=4, profiles=()))
    (bg32, costs32), (bg16, costs16, policy) = (p32.blocks, p32.costs), (p16.blocks, p16.costs, p16.precision)
    assert policy.name == "bf16-mixed"
    assert bg16.num_blocks == bg32.num_blocks == 2
    assert bg32.cut_tensors[1] == (TensorSpec(name="linear_1", shape_per_sample=(8,), dtype="float32"),)
    assert bg16.cut_tensors[1] == (TensorSpec(name="linear_1", shape_per_sample=(8,), dtype="bfloat16"),)
    assert (costs32.cut_bytes_per_sample, costs16.cut_bytes_per_sample) == ((0, 32, 0), (0, 16, 0))
    plan, _ = plan_fixed(captured, ampere, PlanOptions(global_batch_size=4, profiles=()),
                         Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)),
                                  samples_per_microbatch=((2,), (2,)), num_microbatches=2))
    assert plan.precision == "bf16-mixed"
    assert [t.dtype for t in plan.stages[0].send] == [t.dtype for t in plan.stages[1].recv] == ["bfloat16"]
    assert "'dtype': 'bfloat16'" in plan.sources[0] and "'dtype': 'bfloat16'" in plan.sources[1]


def test_float32_cuts_are_priced_as_sent_in_16_bits(gpt):
    """[Note: 16-bit boundary tensors]: a GPT's residual stream is float32
    under autocast (float32 + bfloat16 is float32) and the stage computes it
    so (the plan's specs), but it is sent in the compute dtype, and the
    planner prices the cut at those bytes: half of fp32's, at every cut."""
    ampere = Cluster.from_yaml(AMPERE)
    p32 = price(gpt, ampere, PlanOptions(global_batch_size=4, precision="fp32", profiles=()))
    p16 = price(gpt, ampere, PlanOptions(global_batch_size=4, precision="fp16-mixed", profiles=()))
    inner = range(1, p32.blocks.num_blocks)
    assert all(t.dtype == "float32" for c in inner for t in p16.blocks.cut_tensors[c])
    assert all(p32.costs.cut_bytes_per_sample[c] > 0 for c in inner)
    assert [p16.costs.cut_bytes_per_sample[c] for c in inner] == [p32.costs.cut_bytes_per_sample[c] // 2 for c in inner]
    assert "stage-boundary activations and gradients sent in float16" in p16.precision.describe()


# -- plan.json and the table --------------------------------------------------

@pytest.fixture(scope="module")
def bf16_plan(gpt):
    """A 2-stage plan on A100s with bf16-mixed and bfloat16 gradient reduction."""
    nb = analyse(gpt).num_blocks
    plan, _ = plan_fixed(gpt, Cluster.from_yaml(AMPERE),
                         PlanOptions(global_batch_size=8, precision="bf16-mixed", grad_reduce_dtype="bfloat16"),
                         Decision(stage_blocks=((0, 3), (3, nb)), stage_gpus=((4, 5), (6,)),
                                  samples_per_microbatch=((2, 2), (4,)), num_microbatches=2))
    return plan


def test_plan_round_trip_with_precision(bf16_plan, tmp_path):
    assert (bf16_plan.precision, bf16_plan.grad_reduce_dtype, bf16_plan.compute_dtype) == \
        ("bf16-mixed", "bfloat16", "bfloat16")
    assert bf16_plan.precision_policy() == precision_policy("bf16-mixed", "bfloat16")
    path = bf16_plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    assert d["version"] == PLAN_FORMAT_VERSION == 17
    assert (d["precision"], d["grad_reduce_dtype"], d["compute_dtype"]) == ("bf16-mixed", "bfloat16", "bfloat16")
    loaded = Plan.load(path)
    assert loaded == bf16_plan and loaded.precision_policy().state_bytes_per_param == 20
    # Bfloat16 gradient reduction: its 16-bit bucket copies (2 B/param) are communication buffers.
    s = loaded.stages[1]
    m = s.gpus[0].predicted_memory
    assert (m.weights_bytes, m.gradients_bytes, m.communication_bytes) == tuple(b * s.num_parameters
                                                                                for b in (6, 4, 2))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_plans_load_as_fp32(bf16_plan, tmp_path, version):
    """Plans before format 4 trained in float32, whatever compute_dtype they
    recorded (it only chose datasheet peaks)."""
    path = bf16_plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    d["version"] = version
    del d["precision"], d["grad_reduce_dtype"]
    d["compute_dtype"] = "float16"
    path.write_text(json.dumps(d))
    loaded = Plan.load(path)
    assert (loaded.precision, loaded.grad_reduce_dtype, loaded.compute_dtype) == ("fp32", "float32", "float32")
    assert loaded == dataclasses.replace(bf16_plan, precision="fp32", grad_reduce_dtype="float32")
    assert loaded.version == PLAN_FORMAT_VERSION


@pytest.mark.parametrize(("edit", "message"), [
    (dict(precision="bf16"), "field 'precision' is 'bf16'; allowed: 'fp32', 'bf16-mixed', 'fp16-mixed'"),
    (dict(precision=None), "field 'precision' is None; allowed: 'fp32', 'bf16-mixed', 'fp16-mixed'"),
    (dict(precision="fp16-mixed", compute_dtype="float16"),
     "field 'grad_reduce_dtype' is 'bfloat16'; precision 'fp16-mixed' allows 'float32'"),
    (dict(grad_reduce_dtype="float16"),
     "field 'grad_reduce_dtype' is 'float16'; precision 'bf16-mixed' allows 'float32', 'bfloat16'"),
    (dict(compute_dtype="float16"),
     "field 'compute_dtype' is 'float16' but precision 'bf16-mixed' computes in 'bfloat16'; set compute_dtype "
     "to 'bfloat16' (or remove it) or change precision"),
])
def test_invalid_precision_in_plan_file_is_named(bf16_plan, tmp_path, edit, message):
    path = bf16_plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    d.update(edit)
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError) as e:
        Plan.load(path)
    assert str(e.value) == f"{path}: {message}"


def test_missing_precision_in_a_version_4_file(bf16_plan, tmp_path):
    path = bf16_plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    del d["precision"]
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"missing field 'precision'; re-export the plan with `zorse plan`"):
        Plan.load(path)


def test_table_prints_the_precision(bf16_plan):
    text = bf16_plan.table()
    assert ("precision bf16-mixed: bfloat16 autocast compute; float32 weights, gradients and AdamW state "
            "(16 B/param) + bfloat16 weight copies (2 B/param) + bfloat16 gradient buckets (2 B/param) = 20 "
            "B/param;") in " ".join(line.strip() for line in text.splitlines())
    assert "gradients all-reduced in bfloat16" in text
    assert max(len(line) for line in text.splitlines()) <= 150
    fp32 = dataclasses.replace(bf16_plan, precision="fp32", grad_reduce_dtype="float32")
    assert ("\nprecision fp32: float32 compute (TF32 off), weights, gradients and AdamW state = 16 B/param; gradients "
            "all-reduced in float32") in fp32.table()


# -- TF32 ---------------------------------------------------------------------

def test_tf32_prices_float32_matmuls_from_the_tf32_column():
    """With TF32 on, an A100's and an H100's float32 matmuls run on their tensor
    cores at the datasheet TF32/16-bit peak ratio of their 16-bit rate (a
    fitted class) and the block costs fall; a V100 (no TF32) and a mixed policy
    (no float32 matmuls) are priced as without it."""
    from zorse_fx.cluster import gpu_spec
    from zorse_fx.cost import gpu_model
    from zorse_fx.cost.roofline import MATMUL_EFFICIENCY

    a100, h100, v100 = gpu_spec("A100-40GB"), gpu_spec("H100-80GB"), gpu_spec("V100-16GB")
    assert a100.tf32_flops_per_s == 156e12 and v100.tf32_flops_per_s is None  # gpu_specs.csv
    for spec in (a100, h100):
        r16 = gpu_model.sustained_matmul_flops_per_s(spec, torch.float16, MATMUL_EFFICIENCY)
        assert gpu_model.sustained_matmul_flops_per_s(spec, torch.float32, MATMUL_EFFICIENCY, tf32=True) == \
            pytest.approx(r16 * spec.tf32_flops_per_s / spec.fp16_flops_per_s, rel=1e-12)
    assert gpu_model.sustained_matmul_flops_per_s(v100, torch.float32, MATMUL_EFFICIENCY, tf32=True) == \
        gpu_model.sustained_matmul_flops_per_s(v100, torch.float32, MATMUL_EFFICIENCY)
    # a type outside the fitted classes: the plain roofline at the TF32 peak
    plain = dataclasses.replace(a100, arch=None, sustained_fp16_flops_per_s=None)
    assert gpu_model.sustained_matmul_flops_per_s(plain, torch.float32, MATMUL_EFFICIENCY, tf32=True) == \
        MATMUL_EFFICIENCY * 156e12

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 128))
    bg = analyse(capture(GPT(GPTConfig(n_layer=1, n_embd=256, block_size=128)), (ids, ids)))
    specs = {"A100-40GB": a100, "V100-16GB": v100}
    off, on = (block_costs(bg, specs, precision=precision_policy("fp32", tf32=x)) for x in (False, True))
    assert sum(on.fwd_bwd_s_per_sample["A100-40GB"]) < 0.5 * sum(off.fwd_bwd_s_per_sample["A100-40GB"])
    assert on.fwd_bwd_s_per_sample["V100-16GB"] == off.fwd_bwd_s_per_sample["V100-16GB"]
    mixed = [block_costs(bg, {"A100-40GB": a100}, precision=precision_policy("bf16-mixed", tf32=x))
             for x in (False, True)]
    assert mixed[0].fwd_bwd_s_per_sample == mixed[1].fwd_bwd_s_per_sample


def test_tf32_in_the_plan_and_on_the_ranks(tmp_path):
    """``PlanOptions.tf32`` reaches plan.json, the table and the runtime's policy
    and speeds up an A100 stage (compute-bound float32 matmuls); the H100's
    shipped profile, timed with TF32 off, is set aside and said so; a
    version-11 file (no ``tf32``) reads with it off; the rank sets PyTorch's
    flags both ways on CUDA and leaves a CPU process alone."""
    from zorse_fx.train import runtime_precision

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 128))
    model = capture(GPT(GPTConfig(n_layer=2, n_embd=256, block_size=128)), (ids, ids))
    nb = analyse(model).num_blocks
    decision = Decision(stage_blocks=((0, 3), (3, nb)), stage_gpus=((4, 5), (6,)),
                        samples_per_microbatch=((2, 2), (4,)), num_microbatches=2)
    cluster = Cluster.from_yaml(AMPERE)
    lines: list[str] = []
    price(model, cluster, PlanOptions(global_batch_size=8, precision="fp32", tf32=True), progress=lines.append)
    assert any(x.startswith("TF32 on: the measured profiles of H100-80GB timed float32 matmuls with TF32 off")
               for x in lines), lines
    plans = {x: plan_fixed(model, cluster, PlanOptions(global_batch_size=8, precision="fp32", tf32=x),
                           decision)[0] for x in (False, True)}
    assert plans[True].tf32 and not plans[False].tf32
    assert plans[True].predicted_step_time_s < plans[False].predicted_step_time_s
    path = plans[True].export(tmp_path / "p")
    d = json.loads(path.read_text())
    assert d["tf32"] is True and Plan.load(path) == plans[True]
    assert "float32 compute (TF32 tensor-core matmuls where the GPU has them)" in plans[True].table()
    assert "float32 compute (TF32 off)" in plans[False].table()
    d.update(version=11)
    del d["tf32"]
    path.write_text(json.dumps(d))
    assert Plan.load(path).tf32 is False
    d.update(version=12, tf32="yes")
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match="tf32"):
        Plan.load(path)
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.tf32='yes': use True"):
        PlanOptions(global_batch_size=8, tf32="yes")

    policy, _ = runtime_precision(plans[True], torch.device("cuda"), None)
    assert policy.tf32
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for x in (True, False):
            precision_policy("fp32", tf32=x).apply_matmul_precision("cuda")
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (x, x)
        torch.backends.cuda.matmul.allow_tf32 = True
        precision_policy("fp32").apply_matmul_precision("cpu")
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
