"""Structure of the GPU cost model of types without a profile (issue 13, item 1).

Checks the model against its cited data table (``cost/reference_data.py``)
and the shape of what it prices (fused chains, per-micro-batch weight and
gradient traffic, per-class backward/forward ratios); no timing is asserted
and no GPU is needed.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch

from zorse_fx.capture import analyse, capture
from zorse_fx.cluster import GPUSpec, gpu_spec, known_gpu_types
from zorse_fx.cost import gpu_model
from zorse_fx.cost.reference_data import BANDWIDTH_POINTS, GEMM_POINTS, HELDOUT_PEAKS
from zorse_fx.cost.roofline import (KERNEL_OVERHEAD_S, MATMUL_EFFICIENCY, graph_chains, class_block_time, weight_traffic_bytes, block_costs, node_costs,
                                    node_time_s, saved_activations_or_estimate)
from zorse_fx.precision import precision_policy

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "zorse_fx" / "cluster" / "gpu_specs.csv"


def _rows():
    with open(CSV, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_every_gpu_row_has_the_new_columns_with_a_source():
    """arch for every row; a TF32 figure exactly where the GPU has TF32 and
    the reference gives it (none before Ampere); every measured sustained
    figure and every clock carries a URL in ``sustained_source``."""
    for r in _rows():
        assert r["arch"] in gpu_model.ARCH_EFFICIENCY or r["arch"] in ("blackwell", "cdna2", "cdna3"), r["type"]
        if r["arch"] in ("pascal", "volta", "turing"):
            assert r["tf32_tensor_tflops"] == "", r["type"]
        if r["sustained_fp16_tflops"] or r["boost_clock_mhz"] or r["base_clock_mhz"]:
            assert "http" in r["sustained_source"], r["type"]
        if r["tf32_tensor_tflops"]:
            # TF32 dense is half the 16-bit dense peak on every NVIDIA tensor-core part listed
            # (datasheets), except the GeForce half-rate 16-bit parts (RTX 4090: equal) and the
            # measured A10G
            ratio = float(r["fp16_tensor_tflops"]) / float(r["tf32_tensor_tflops"])
            assert 1.0 <= ratio <= 2.05, r["type"]
    spec = gpu_spec("T4")
    assert (spec.boost_clock_mhz, spec.base_clock_mhz, spec.tdp_w) == (1590.0, 585.0, 70.0)
    assert gpu_spec("A100-40GB").tf32_flops_per_s == 156e12


def test_every_fit_and_holdout_row_is_cited_and_roles_are_disjoint():
    fits = [p for p in GEMM_POINTS if p.role == "fit"]
    held = [p for p in GEMM_POINTS if p.role == "holdout"]
    assert fits and held and len(fits) + len(held) == len(GEMM_POINTS)
    assert all(p.source.startswith("http") for p in GEMM_POINTS)
    assert all(p.fits == "" for p in held)
    assert not {p.gpu for p in fits} & {p.gpu for p in held}
    for gpu, (arch, *_rest, source) in HELDOUT_PEAKS.items():
        assert source.startswith("http") and arch in gpu_model.ARCH_EFFICIENCY


def _errors(role):
    out = {}
    for p in GEMM_POINTS:
        if p.role == role:
            arch, peak, tdp = gpu_model.reference_peak(p.gpu)
            out[p.gpu] = gpu_model.predicted_sustained_fp16(arch, peak, tdp) / (p.tflops * 1e12) - 1
    return out


def test_class_model_reproduces_its_fit_rows_and_the_holdout_bound():
    """Fit rows come back (a row of an efficiency fit exactly; a power-cap row
    exactly unless its class's efficiency binds first), and the held-out rows
    stay within the bound bench/gpu_roofline_accuracy.py reports (median
    |error| <= 13%, max <= 20%), better than the old 0.6-of-peak roofline."""
    fit = _errors("fit")
    exact = [p.gpu for p in GEMM_POINTS if p.role == "fit" and p.gpu != "RTX-A2000"]
    assert all(abs(fit[g]) < 1e-9 for g in exact)
    held = _errors("holdout")
    med, mx = statistics.median(abs(e) for e in held.values()), max(abs(e) for e in held.values())
    assert med <= 0.13 and mx <= 0.20, held
    old = []
    for p in GEMM_POINTS:
        if p.role == "holdout":
            arch, peak, _ = gpu_model.reference_peak(p.gpu)
            old.append(abs(MATMUL_EFFICIENCY * peak * (2 if arch == "pascal" else 1) / (p.tflops * 1e12) - 1))
    assert statistics.median(old) > med


def test_stream_efficiency_is_the_median_of_its_cited_fit_rows():
    """The class model's bandwidth fraction comes from the cited copy
    measurements; held-out GPUs stay within 20%."""
    fracs = [p.gbps * 1e9 / gpu_spec(p.gpu).mem_bw_bytes_per_s for p in BANDWIDTH_POINTS if p.role == "fit"]
    assert gpu_model.STREAM_EFFICIENCY == pytest.approx(statistics.median(fracs))
    assert all(p.source.startswith("http") for p in BANDWIDTH_POINTS)
    for p in BANDWIDTH_POINTS:
        if p.role == "holdout":
            pred = gpu_model.STREAM_EFFICIENCY * gpu_spec(p.gpu).mem_bw_bytes_per_s
            assert abs(pred / (p.gbps * 1e9) - 1) <= 0.20, p.gpu


def test_sustained_fraction_of_peak_by_class():
    """(i) of the issue: full-power datacenter cards sustain most of their
    peak, 70 W cards (T4, L4) under half, Pascal far less than its
    packed-FP16 figure (it runs FP16/FP32-accumulate GEMMs at the FP32 rate)."""
    def frac(t):
        spec = gpu_spec(t)
        return gpu_model.sustained_matmul_flops_per_s(spec, torch.float16, MATMUL_EFFICIENCY) / spec.fp16_flops_per_s

    for t in ("V100-16GB", "A100-40GB", "A100-80GB", "H100-80GB", "RTX-A6000"):
        assert frac(t) >= 0.7, t
    for t in ("T4", "L4", "A10"):
        assert frac(t) < 0.5, t
    assert frac("P100-16GB") < 0.4
    # a 150 W A10 is capped by its board power: the class model caps it below its GA10x efficiency
    a10 = gpu_spec("A10")
    assert gpu_model.predicted_sustained_fp16("ampere-ga10x", a10.fp16_flops_per_s, a10.tdp_w) == pytest.approx(
        a10.tdp_w / gpu_model.ENERGY_J_PER_FLOP["ampere-ga10x"])


def _llama(seq=64, max_positions=256, causal_masks=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=max_positions))
    ids = torch.zeros((2, seq), dtype=torch.long, device="meta")
    return analyse(capture(CausalLMWithLoss(m), (ids, ids), method="export", causal_masks=causal_masks))


@pytest.fixture(scope="module")
def llama():
    bg = _llama()
    pol = precision_policy("fp16-mixed")
    costs = node_costs(bg, saved_activations_or_estimate(bg, pol), pol)
    layer = [b for b in range(bg.num_blocks) if bg.describe_blocks(b, b + 1) == "L0"]
    return bg, pol, costs, layer


def test_fused_chains_move_fewer_bytes_than_every_kernel(llama):
    """(ii): norms, rotary, SwiGLU and residual adds are grouped into chains
    that move less than the sum of their kernels' bytes, in fewer kernels."""
    bg, _, costs, layer = llama
    chains = graph_chains(bg, costs)
    members = [n for b in range(bg.num_blocks) for n in bg.block_nodes(b)
               if costs[n].bytes > 0 and not costs[n].is_matmul]
    # every elementwise kernel of the model is in exactly one chain, charged to one block
    assert sorted(n for cs in chains.values() for c in cs for n in c.nodes) == sorted(members)
    ours = [c for b in layer for c in chains[b]]
    kernels = [n for c in ours for n in c.nodes]
    assert len(ours) < len(kernels)
    assert sum(c.bytes for c in ours) < sum(costs[n].bytes for n in kernels)


def test_chains_priced_between_fused_and_eager(llama):
    """A chain pays ``UNFUSED_FRACTION`` of the way from its fused bytes and
    one kernel to the sum of its nodes' bytes and one kernel per node."""
    bg, pol, costs, layer = llama
    spec = gpu_spec("A100-40GB")
    bw = spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY
    chains = graph_chains(bg, costs)
    f = gpu_model.UNFUSED_FRACTION
    assert 0.0 < f < 1.0
    for b in layer:
        fused_bytes = sum(c.bytes for c in chains[b])
        eager_bytes = sum(costs[n].bytes for c in chains[b] for n in c.nodes)
        nodes = sum(len(c.nodes) for c in chains[b])
        assert eager_bytes > fused_bytes
        got = class_block_time(bg, costs, b, chains[b], 0.0, spec, pol)
        fused = class_block_time(bg, costs, b, chains[b], 0.0, spec, pol, 0.0)
        eager = class_block_time(bg, costs, b, chains[b], 0.0, spec, pol, 1.0)
        # forward per sample: the chain bytes once at the streaming bandwidth
        assert got[0] - fused[0] == pytest.approx(f * (eager_bytes - fused_bytes) / bw, rel=1e-9)
        assert eager[0] - fused[0] == pytest.approx((eager_bytes - fused_bytes) / bw, rel=1e-9)
        # backward per sample: CHAIN_BWD_FACTOR x the forward chain bytes
        assert eager[1] - fused[1] == pytest.approx(
            gpu_model.CHAIN_BWD_FACTOR * (eager_bytes - fused_bytes) / bw, rel=1e-9)
        # kernels: one per chain fused, one per node eager (1 forward + 2 backward)
        extra = (nodes - len(chains[b])) * KERNEL_OVERHEAD_S
        assert (eager[2] - fused[2], eager[3] - fused[3]) == pytest.approx((extra, 2 * extra), rel=1e-9)
        assert got[2] - fused[2] == pytest.approx(f * extra, rel=1e-9)
    got = block_costs(bg, {"A100-40GB": spec}, precision=pol)
    for b in layer:
        pf, pb, ff, fb = class_block_time(bg, costs, b, chains[b], weight_traffic_bytes(bg, b, pol), spec, pol)
        assert got.fwd_bwd_s_per_sample["A100-40GB"][b] == pytest.approx(pf + pb, rel=1e-12)


def test_fit_unfused_fraction():
    """The median implied fraction, clipped to [0, 1]; bad input refused."""
    # implied fractions 0.25, 0.5, 1.5 -> median 0.5
    assert gpu_model.fit_unfused_fraction([(1.25, 1.0, 2.0), (2.0, 1.0, 3.0), (2.5, 1.0, 2.0)]) == 0.5
    assert gpu_model.fit_unfused_fraction([(0.5, 1.0, 2.0)]) == 0.0
    assert gpu_model.fit_unfused_fraction([(3.0, 1.0, 2.0)]) == 1.0
    with pytest.raises(ValueError):
        gpu_model.fit_unfused_fraction([])
    with pytest.raises(ValueError):
        gpu_model.fit_unfused_fraction([(1.0, 2.0, 2.0)])


def test_per_micro_batch_weight_and_gradient_traffic(llama):
    """(iii): the fixed (per micro-batch) backward cost holds the 16-bit
    weight read and the FP32 gradient read+write of every parameter, at the
    model's bandwidth, on top of the per-kernel overhead."""
    bg, pol, costs, layer = llama
    state, trainable = bg.captured.state(), bg.captured.trainable()
    spec = gpu_spec("T4")
    for b in layer:
        params = sum(state[a].numel() for a in bg.block_attrs[b] if a in trainable)
        assert weight_traffic_bytes(bg, b, pol) == params * 10  # fp16 weight read + fp32 grad read/write
        assert weight_traffic_bytes(bg, b, precision_policy("fp32")) == params * 12
        chains = graph_chains(bg, costs)[b]
        _, _, _, fb = class_block_time(bg, costs, b, chains, params * 10, spec, pol)
        _, _, _, fb0 = class_block_time(bg, costs, b, chains, 0, spec, pol)
        assert fb - fb0 == pytest.approx(params * 10 / (spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY))
    got = block_costs(bg, {"T4": spec}, precision=pol)
    assert all(got.fwd_bwd_s_fixed["T4"][b] > 0 for b in layer)


def test_backward_forward_ratio_by_class_and_micro_batch(llama):
    """(iv): the backward/forward ratio is not a constant 2: it is larger at
    micro-batch 1 (weight and gradient traffic) than at a large micro-batch,
    and differs between GPU classes (bandwidth-poor T4 vs A100)."""
    bg, pol, costs, layer = llama

    def ratio(t, n):
        f = bw = 0.0
        for b in layer:
            pf, pb, ff, fb = class_block_time(bg, costs, b, graph_chains(bg, costs)[b],
                                               weight_traffic_bytes(bg, b, pol), gpu_spec(t), pol)
            f, bw = f + pf * n + ff, bw + pb * n + fb
        return bw / f

    for t in ("T4", "A100-40GB", "P100-16GB", "RTX-3090"):
        assert ratio(t, 1) > ratio(t, 64) >= 1.9
    assert len({round(ratio(t, 1), 3) for t in ("T4", "A100-40GB", "P100-16GB", "L4")}) == 4
    # block_costs keeps that split (issue 32 item 5): the forward part of every block is
    # the class model's own forward, which the schedule, GPipe and recomputation read.
    got = block_costs(bg, {"T4": gpu_spec("T4")}, precision=pol)
    chains = graph_chains(bg, costs)
    for b in range(bg.num_blocks):
        pf, pb, ff, fb = class_block_time(bg, costs, b, chains[b], weight_traffic_bytes(bg, b, pol), gpu_spec("T4"), pol)
        assert got.fwd_s_per_sample["T4"][b] == pytest.approx(pf, rel=1e-12)
        assert got.fwd_s_fixed["T4"][b] == pytest.approx(ff, rel=1e-12)
        assert got.fwd_bwd_s_per_sample["T4"][b] == pytest.approx(pf + pb, rel=1e-12)


def test_half_precision_graph_runs_16_bit_matmuls_without_autocast():
    """A model captured in float16 and planned under the fp32 policy (no
    autocast) still runs its GEMMs in float16: they are priced at the 16-bit
    sustained rate, not at 0.6 of the FP32 peak."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256))
    ids = torch.zeros((2, 64), dtype=torch.long, device="meta")
    bg = analyse(capture(CausalLMWithLoss(m.to(torch.float16)), (ids, ids), method="export"))
    costs = node_costs(bg)
    assert any(c.half for c in costs.values()) and all(c.half for c in costs.values() if c.is_matmul and c.flops > 0
                                                        and c.bytes > 0 and c.flops > 1e6)
    a100 = gpu_spec("A100-40GB")
    got = block_costs(bg, {"A100-40GB": a100}, precision=precision_policy("fp32"))
    layer = [b for b in range(bg.num_blocks) if bg.describe_blocks(b, b + 1) == "L0"]
    for b in layer:
        f, bw, _, _ = class_block_time(bg, costs, b, graph_chains(bg, costs)[b], 0.0, a100, precision_policy("fp32"))
        assert got.fwd_bwd_s_per_sample["A100-40GB"][b] == pytest.approx(f + bw)
    fp32_graph = _llama()
    c32 = node_costs(fp32_graph)
    assert not any(c.half for c in c32.values())


def test_cluster_declared_types_keep_the_plain_roofline(llama):
    """A GPU type declared in a cluster file (no class) is priced as before:
    3x the forward roofline, 3 kernel overheads per kernel."""
    bg, pol, costs, layer = llama
    mine = GPUSpec(type="MyGPU", memory_bytes=32 * 2**30, mem_bw_bytes_per_s=900e9, fp32_flops_per_s=15e12,
                   fp16_flops_per_s=120e12, bf16_supported=False, source="test")
    assert not gpu_model.has_class_model(mine)
    got = block_costs(bg, {"MyGPU": mine}, precision=pol)
    for b in range(bg.num_blocks):
        expected = 3 * sum(node_time_s(costs[n], mine, torch.float16) for n in bg.block_nodes(b))
        assert got.fwd_bwd_s_per_sample["MyGPU"][b] == pytest.approx(expected, rel=1e-12)


def test_every_table_gpu_is_priced_by_the_class_model():
    for t in known_gpu_types():
        spec = gpu_spec(t)
        if spec.arch in gpu_model.ARCH_EFFICIENCY:
            assert gpu_model.has_class_model(spec)
            if spec.bf16_supported or spec.arch in ("pascal", "volta", "turing"):
                assert gpu_model.sustained_matmul_flops_per_s(spec, torch.float16, MATMUL_EFFICIENCY) > 0


def _llama_layers(layers: int):
    """A ``layers``-layer tiny HF Llama (seq 64), captured once; its graphs at
    64 blocks and at 5 (coarser blocks, a subset of the same cuts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=256))
    ids = torch.zeros((2, 64), dtype=torch.long, device="meta")
    captured = capture(CausalLMWithLoss(m), (ids, ids), method="export")
    return analyse(captured), analyse(captured, max_blocks=5)


@pytest.fixture(scope="module")
def llama23():
    return {layers: _llama_layers(layers) for layers in (2, 3)}


def test_no_chain_has_a_matmul_between_its_nodes(llama23):
    """A chain is fusable: for every matmul/attention node ``m``, no chain has
    a node upstream of ``m`` and another downstream of it (checked by
    reachability, not through ``kernel_depths``). So the residual stream is
    not one chain: no chain covers more than two consecutive blocks (the add
    closing a block and the norm opening the next), and no chain holds nodes
    of two decoder layers' attention or MLP sub-blocks."""
    bg, _ = llama23[3]
    pol = precision_policy("bf16-mixed")
    costs = node_costs(bg, saved_activations_or_estimate(bg, pol), pol)
    chains = [c for cs in graph_chains(bg, costs).values() for c in cs]
    block_of = {n: b for b in range(bg.num_blocks) for n in bg.block_nodes(b)}
    nodes = list(bg.graph.nodes)
    matmuls = [n for n in nodes if n.name in costs and costs[n.name].is_matmul]
    assert len(matmuls) >= 3 * 7  # q, k, v, o, gate, up, down (+ attention, lm_head)

    def closure(start, step):
        seen, todo = set(), list(step(start))
        while todo:
            x = todo.pop()
            if x.name not in seen:
                seen.add(x.name)
                todo.extend(step(x))
        return seen

    for m in matmuls:
        up = closure(m, lambda x: x.all_input_nodes)
        down = closure(m, lambda x: x.users)
        for c in chains:
            assert not (up & set(c.nodes) and down & set(c.nodes)), (m.name, c.nodes)
    for c in chains:
        blocks = sorted({block_of[n] for n in c.nodes})
        assert blocks[-1] - blocks[0] <= 1, c.nodes
    # the chains crossing a cut: one per cut between the embedding and the final norm
    crossing = [c for c in chains if len({block_of[n] for n in c.nodes}) > 1]
    assert len(crossing) == bg.num_blocks - 2


def test_last_block_price_does_not_grow_with_the_layer_count(llama23):
    """The class model prices the final norm + LM head block, and every block
    up to the last decoder layer, the same in a 2- and a 3-layer model of one
    shape: no layer's residual or norm traffic lands on the last block (it
    did while the residual stream was one chain charged to the final norm)."""
    pol = precision_policy("bf16-mixed")
    spec = {"H100-80GB": gpu_spec("H100-80GB")}
    got = {}
    for layers, (bg, _) in llama23.items():
        names = [bg.describe_blocks(b, b + 1) for b in range(bg.num_blocks)]
        assert names.count("norm, lm_head") == 1
        c = block_costs(bg, spec, precision=pol)
        got[layers] = (names, c.fwd_bwd_s_per_sample["H100-80GB"], c.fwd_bwd_s_fixed["H100-80GB"])
    (n2, t2, f2), (n3, t3, f3) = got[2], got[3]
    assert len(n3) == len(n2) + 2  # one more layer: its attention and MLP blocks
    last2, last3 = n2.index("norm, lm_head"), n3.index("norm, lm_head")
    assert t2[last2] > 0
    assert (t3[last3], f3[last3]) == pytest.approx((t2[last2], f2[last2]), rel=1e-12)
    assert t3[last3 + 1:] == pytest.approx(t2[last2 + 1:], rel=1e-12)
    # the blocks of the first layer are priced the same too, and layer 2 as layer 1
    assert t3[:last2 - 2] == pytest.approx(t2[:last2 - 2], rel=1e-12)
    assert t3[last3 - 2:last3] == pytest.approx(t2[last2 - 2:last2], rel=1e-12)


def test_stage_price_does_not_depend_on_the_block_cuts(llama23):
    """Each chain is charged whole to the block of its last node, so a run of
    blocks is priced the same cut finely (64 blocks) or coarsely (5 blocks,
    a subset of the same cuts): a plan's step time depends on its stage
    boundaries only."""
    pol = precision_policy("bf16-mixed")
    specs = {t: gpu_spec(t) for t in ("H100-80GB", "A100-40GB")}
    fine, coarse = llama23[3]
    firsts = [fine.block_nodes(b)[0] for b in range(fine.num_blocks)]
    starts = [firsts.index(coarse.block_nodes(b)[0]) for b in range(coarse.num_blocks)] + [fine.num_blocks]
    assert coarse.num_blocks < fine.num_blocks and starts == sorted(starts)
    cf, cc = block_costs(fine, specs, precision=pol), block_costs(coarse, specs, precision=pol)
    for t in specs:
        for b in range(coarse.num_blocks):
            lo, hi = starts[b], starts[b + 1]
            assert cc.fwd_bwd_s_per_sample[t][b] == pytest.approx(sum(cf.fwd_bwd_s_per_sample[t][lo:hi]), rel=1e-9)
            assert cc.fwd_bwd_s_fixed[t][b] == pytest.approx(sum(cf.fwd_bwd_s_fixed[t][lo:hi]), rel=1e-9)


def test_attention_efficiency_is_recomputed_from_its_cited_rows():
    """Each (class, kernel) attention efficiency is the median over its cited
    sweep of attention TFLOP/s / the same GPU's GEMM fit row, forward and
    backward; every row is cited, and every kernel SDPA_KERNELS names has a
    rate on that class."""
    from zorse_fx.cost.reference_data import ATTENTION_POINTS

    gemm = {p.gpu: p.tflops for p in GEMM_POINTS if p.role == "fit"}
    expected: dict = {}
    for p in ATTENTION_POINTS:
        assert len(p.seq_lens) == len(p.tflops) and p.direction in ("fwd", "bwd")
        if not p.source.startswith("http"):  # our own measurement: the rows of the record it names
            record = json.loads((Path(__file__).resolve().parents[1] / p.source.split()[0]).read_text())
            rows = {r["seq"]: r for r in record["attention"] if r["variant"] == "sdpa_mask" and r["micro_batch"] == 4}
            assert p.kernel == "cudnn_mask" and all("cudnn" in r["kernels"][0][0] for r in rows.values())
            assert p.tflops == tuple(round(rows[t][f"{p.direction}_tflops"], 1) for t in p.seq_lens)
        arch = gpu_spec(p.gpu).arch
        expected.setdefault((arch, p.kernel), {})[p.direction] = statistics.median(t / gemm[p.gpu] for t in p.tflops)
    assert set(expected) == set(gpu_model.ATTENTION_EFFICIENCY)
    for key, d in expected.items():
        assert gpu_model.ATTENTION_EFFICIENCY[key] == pytest.approx((d["fwd"], d["bwd"]), rel=1e-12)
    for arch, kernels in gpu_model.SDPA_KERNELS.items():
        assert all((arch, k) in gpu_model.ATTENTION_EFFICIENCY for k in kernels)
    # the cited Hopper kernels run attention below the GEMM rate, backward slower than forward
    for fwd, bwd in gpu_model.ATTENTION_EFFICIENCY.values():
        assert 0 < bwd < fwd < 1
    r = 700e12
    assert gpu_model.attention_flops_per_s("hopper", r, False) == pytest.approx(
        tuple(e * r for e in gpu_model.ATTENTION_EFFICIENCY[("hopper", "cudnn")]))
    assert gpu_model.attention_flops_per_s("hopper", r, True) == pytest.approx(
        tuple(e * r for e in gpu_model.ATTENTION_EFFICIENCY[("hopper", "cudnn_mask")]))
    # an explicit mask costs cuDNN about half its unmasked rate (measured on one H100)
    masked, unmasked = gpu_model.ATTENTION_EFFICIENCY[("hopper", "cudnn_mask")], gpu_model.ATTENTION_EFFICIENCY[
        ("hopper", "cudnn")]
    assert all(0.4 < m / u < 0.7 for m, u in zip(masked, unmasked))
    for arch in ("ampere-ga100", "volta", "turing", None):
        assert gpu_model.attention_flops_per_s(arch, r, True) == (r, r)


def _attention_nodes(bg, blocks):
    from zorse_fx.cost.opclass import op_class

    nodes = {x.name: x for x in bg.graph.nodes}
    return [n for b in blocks for n in bg.block_nodes(b) if op_class(nodes[n]) == "attention"]


def _attention_terms(bg, costs, b, spec, rate_f, rate_b):
    """Forward and backward seconds per sample of block ``b``'s attention
    nodes at the given rates (the class model's attention term)."""
    bw = spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY
    f = bwd = 0.0
    for n in _attention_nodes(bg, [b]):
        c = costs[n]
        flops = 0.5 * c.flops if c.causal else c.flops
        f += max(flops / rate_f, c.bytes / bw)
        bwd += max(gpu_model.ATTENTION_BWD_FACTOR * flops / rate_b, 2 * c.bytes / bw)
    return f, bwd


def test_attention_priced_at_the_class_rate_and_unlisted_classes_as_before(monkeypatch):
    """The export-captured HF Llama with its explicit attention mask kept (the capture
    pass off, ``causal_masks=False``): on
    Hopper its attention runs at the masked cuDNN rates, and the block's price moves
    by exactly the attention term; a class without a cited attention rate
    (Ampere, Turing, Ada) is priced as before (attention at the matmul rate).
    Sequence 2048, so that attention is compute-bound on every type priced."""
    bg = _llama(seq=2048, max_positions=2048, causal_masks=False)
    pol = precision_policy("fp16-mixed")
    costs = node_costs(bg, saved_activations_or_estimate(bg, pol), pol)
    layer = [b for b in range(bg.num_blocks) if bg.describe_blocks(b, b + 1) == "L0"]
    attn = _attention_nodes(bg, layer)
    assert attn and all(costs[n].masked and costs[n].half for n in attn)

    def price(t):
        spec = gpu_spec(t)
        return [class_block_time(bg, costs, b, graph_chains(bg, costs)[b], weight_traffic_bytes(bg, b, pol), spec, pol)
                for b in layer]

    now = {t: price(t) for t in ("H100-80GB", "A100-40GB", "T4", "L4")}
    monkeypatch.setattr(gpu_model, "SDPA_KERNELS", {})
    before = {t: price(t) for t in now}
    for t in ("A100-40GB", "T4", "L4"):
        assert now[t] == before[t], t
    spec = gpu_spec("H100-80GB")
    r = gpu_model.sustained_matmul_flops_per_s(spec, torch.float16, MATMUL_EFFICIENCY)
    ef, eb = gpu_model.ATTENTION_EFFICIENCY[("hopper", "cudnn_mask")]
    for b, new, old in zip(layer, now["H100-80GB"], before["H100-80GB"]):
        nf, nb = _attention_terms(bg, costs, b, spec, ef * r, eb * r)
        of, ob = _attention_terms(bg, costs, b, spec, r, r)
        assert new[0] - old[0] == pytest.approx(nf - of, rel=1e-9, abs=1e-15)
        assert new[1] - old[1] == pytest.approx(nb - ob, rel=1e-9, abs=1e-15)
        assert new[2:] == old[2:]
    assert sum(n[0] + n[1] for n in now["H100-80GB"]) > sum(o[0] + o[1] for o in before["H100-80GB"])


class _CausalSDPA(torch.nn.Module):
    """q/k/v projections and ``scaled_dot_product_attention(is_causal=True)``
    (no ``attn_mask``)."""

    def __init__(self, width=256, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(width, 3 * width, bias=False)

    def forward(self, x):
        n, t, w = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_unmasked_causal_attention_is_priced_at_the_cudnn_rate():
    """An SDPA node without ``attn_mask`` is priced on Hopper at the unmasked
    cuDNN ratios (what PyTorch 2.11 ran on our H100), causal at half the FLOPs."""
    with torch.device("meta"):
        model = _CausalSDPA()
    bg = analyse(capture(model, (torch.zeros((2, 2048, 256), device="meta"),), method="export"))
    pol = precision_policy("bf16-mixed")
    costs = node_costs(bg, saved_activations_or_estimate(bg, pol), pol)
    attn = _attention_nodes(bg, range(bg.num_blocks))
    assert len(attn) == 1 and costs[attn[0]].causal and not costs[attn[0]].masked and costs[attn[0]].half
    b = next(b for b in range(bg.num_blocks) if attn[0] in bg.block_nodes(b))
    spec = gpu_spec("H100-80GB")
    r = gpu_model.sustained_matmul_flops_per_s(spec, torch.bfloat16, MATMUL_EFFICIENCY)
    ef, eb = gpu_model.ATTENTION_EFFICIENCY[("hopper", "cudnn")]
    got = class_block_time(bg, costs, b, graph_chains(bg, costs)[b], weight_traffic_bytes(bg, b, pol), spec, pol)
    rest = [n for n in bg.block_nodes(b) if n != attn[0] and costs[n].is_matmul]
    flops = 0.5 * costs[attn[0]].flops
    assert flops / (ef * r) > costs[attn[0]].bytes / (spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY)
    other_f = sum(max(costs[n].flops / r, costs[n].bytes / (spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY))
                  for n in rest)
    chains_f = sum(ch.priced(gpu_model.UNFUSED_FRACTION)[0] for ch in graph_chains(bg, costs)[b]) / (
        spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY)
    assert got[0] == pytest.approx(flops / (ef * r) + other_f + chains_f, rel=1e-9)
