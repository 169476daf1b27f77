"""Kernel profiles and the measured cost model: file format, lookup order
(exact -> interpolated -> roofline with learned efficiency), block costs from
two micro-batch sizes, and the `zorse bench kernels` harness on a real model."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import small_gpt
from zorse_fx.capture import analyse
from zorse_fx.cluster import gpu_spec
from zorse_fx.cost.measured import ProfileSet, _interpolate, measured_block_costs, node_time
from zorse_fx.cost.roofline import block_costs
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.precision import precision_policy
from zorse_fx.cost.profile import DeviceInfo, KernelProfile, KernelTiming
from zorse_fx.errors import FileFormatError, ProfileFileError
from zorse_fx.cost.replay import NodeCall, model_calls

T = 16


def _timing(key, cls, fwd, bwd, flops=0.0, nbytes=0.0, impl="torch", dtype="float32"):
    return KernelTiming(key=key, op_class=cls, impl=impl, dtype=dtype, shape={}, fwd_ms=fwd, bwd_ms=bwd,
                        flops=flops, bytes=nbytes)


def _profile(device_type="T4", backend="cuda", entries=(), calibration=1.0):
    return KernelProfile(device=DeviceInfo(device_type=device_type, name="test", backend=backend, torch_version="x"),
                         measured_at="2026-11-22T00:00:00Z", overhead_ms=0.005, entries=tuple(entries),
                         calibration=calibration)


def _call(key="k", cls="matmul", flops=1e9, nbytes=1e6):
    return NodeCall(key=key, op_class=cls, target=None, args=(), kwargs={}, flops=flops, bytes=nbytes)


def test_profile_round_trip_and_bad_files(tmp_path):
    p = _profile(entries=[_timing("a", "matmul", 1.0, 2.0, 1e9, 1e6)], calibration=1.07)
    path = p.save(tmp_path / "p.json")
    q = KernelProfile.load(path)
    assert q == p and q.calibration == 1.07 and q.lookup("a").bwd_ms == 2.0
    d = json.loads(path.read_text())
    d["entries"][0]["fwd_ms"] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: field entries\[0\]\.fwd_ms is -1: expected "
                                         r"`float` > 0\.0 \(forward time, ms, > 0\); correct it or re-run "
                                         r"`zorse bench kernels`"):
        KernelProfile.load(path)
    d["format"] = "other"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"not a zorse_fx kernel profile \(field 'format' is 'other', expected "
                                         r"'zorse_fx.kernel_profile'\)"):
        KernelProfile.load(path)
    with pytest.raises(ValueError, match="missing.json: no such kernel profile file; create one with "
                                         "`zorse bench kernels"):
        KernelProfile.load(tmp_path / "missing.json")


@pytest.mark.parametrize("mutate,field,value", [
    (lambda d: d["entries"][0].update(flops="1e9"), "entries[0].flops", "1e9"),  # wrong type
    (lambda d: d["device"].update(threads=0), "device.threads", 0),  # out of range
    (lambda d: d["entries"][0].update(op_class="conv"), "entries[0].op_class", "conv"),  # not an allowed value
    (lambda d: d.update(calibraton=1.1), "'calibraton'", 1.1),  # unknown field (a typo)
])
def test_bad_profile_fields_name_file_field_and_value(tmp_path, mutate, field, value):
    d = _profile(entries=[_timing("a", "matmul", 1.0, 2.0, 1e9, 1e6)]).to_dict()
    mutate(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FileFormatError) as e:
        KernelProfile.load(path)
    assert isinstance(e.value, ProfileFileError) and isinstance(e.value, ValueError)
    assert (e.value.path, e.value.field, e.value.value) == (str(path), field, value)
    assert str(e.value).startswith(f"{path}: ") and field in str(e.value)
    # the fix (an enum's error lists the allowed values instead)
    assert str(e.value).endswith("re-run `zorse bench kernels`") or "; allowed: " in str(e.value)


def test_lookup_order_exact_then_interpolated_then_roofline():
    t4 = gpu_spec("T4")
    prof = _profile(entries=[_timing("exact", "matmul", 2.0, 4.0, 1e9),
                             _timing("m1", "matmul", 1.0, 2.0, 1e8), _timing("m2", "matmul", 10.0, 20.0, 1e10)],
                    calibration=1.5)
    ps = ProfileSet([prof])
    specs = {"T4": t4}
    hit = node_time(_call("exact"), "T4", ps, t4, specs, torch.float32)
    assert (hit.source, hit.fwd_ms, hit.bwd_ms) == ("exact", 3.0, 6.0)  # x calibration 1.5
    # Points (1e8, 1), (1e9, 2), (1e10, 10) ms: log-log midpoint of the last two, x calibration.
    mid = node_time(_call("new", flops=10 ** 9.5), "T4", ps, t4, specs, torch.float32)
    assert mid.source == "interpolated" and mid.fwd_ms == pytest.approx(1.5 * 20 ** 0.5)
    assert mid.bwd_ms == pytest.approx(2 * mid.fwd_ms)
    # A type without a profile: roofline, efficiency learned from the T4 profile (achieved / peak).
    v100 = gpu_spec("V100-16GB")
    roof = node_time(_call("new", flops=1e9), "V100-16GB", ps, v100, {**specs, "V100-16GB": v100}, torch.float32)
    eff = ps.learned_efficiency("matmul", specs)
    assert roof.source == "roofline" and eff[1] == "learned"
    assert roof.fwd_ms == pytest.approx((1e9 / (v100.fp32_flops_per_s * eff[0]) + 5e-6) * 1e3)
    with pytest.raises(ValueError, match="has no measured profile and no datasheet entry"):
        node_time(_call("new"), "Mystery", ps, None, specs, torch.float32)


def test_matmul_timings_apply_only_in_the_compute_dtype():
    """A mixed precision plan runs matmuls in float16 under autocast: the
    float32 timing of the very node does not price it, float16 timings of the
    class do (interpolated), and without any the roofline at the float16
    peak. Other classes take their timing whatever its dtype."""
    t4 = gpu_spec("T4")
    specs = {"T4": t4}
    ps = ProfileSet([_profile(entries=[_timing("exact", "matmul", 2.0, 4.0, 1e9),
                                       _timing("h1", "matmul", 0.5, 1.0, 1e8, dtype="float16"),
                                       _timing("h2", "matmul", 1.0, 2.0, 1e10, dtype="float16"),
                                       _timing("n", "norm", 0.3, 0.6, 0.0, 1e6)])])
    assert node_time(_call("exact"), "T4", ps, t4, specs, torch.float32).source == "exact"
    half = node_time(_call("exact"), "T4", ps, t4, specs, torch.float16)
    # Log-log midpoint of (1e8, 0.5 ms) and (1e10, 1 ms) at 1e9 FLOPs; backward 2x (the entries' ratio).
    assert half.source == "interpolated"
    assert (half.fwd_ms, half.bwd_ms) == (pytest.approx(0.5 ** 0.5), pytest.approx(2 * 0.5 ** 0.5))
    assert node_time(_call("n", cls="norm"), "T4", ps, t4, specs, torch.float16).source == "exact"
    only32 = ProfileSet([_profile(entries=[_timing("exact", "matmul", 2.0, 4.0, 1e9)])])
    roof = node_time(_call("exact"), "T4", only32, t4, specs, torch.float16)
    eff, _ = only32.learned_efficiency("matmul", specs)
    assert roof.source == "roofline"
    assert roof.fwd_ms == pytest.approx((1e9 / (t4.fp16_flops_per_s * eff) + 5e-6) * 1e3)


def test_interpolation_extrapolates_proportionally_and_floors():
    pts = [(10.0, 1.0), (1000.0, 10.0)]
    assert _interpolate(pts, 1.0) == 1.0
    assert _interpolate(pts, 2000.0) == pytest.approx(20.0)
    assert _interpolate(pts, 100.0) == pytest.approx(10 ** 0.5)


def test_measured_block_costs_from_replayed_model():
    """Profile the model's own nodes (real timings, 1 repeat) and price its blocks."""
    from zorse_fx.cost.replay import time_call

    captured = small_gpt(seq=T)
    bg = analyse(captured)
    entries = {}
    for n in (1, 4):
        for call in model_calls(captured, n).values():
            if call.key not in entries:
                fwd, bwd = time_call(call, torch.device("cpu"), repeats=1)
                entries[call.key] = _timing(call.key, call.op_class, max(fwd, 1e-6), bwd, call.flops, call.bytes)
    ps = ProfileSet([_profile("cpu-test", "cpu", entries.values())])
    base = block_costs(bg, {"T4": gpu_spec("T4")}, precision=precision_policy("fp32"))
    costs, sources = measured_block_costs(bg, {"cpu-test": None, "T4": gpu_spec("T4")}, ps, batches=(1, 4), base=base)
    assert set(sources["cpu-test"]) == {"exact"}
    # A table GPU without a profile beside a profiled type: priced as with no profiles (the class model).
    assert set(sources["T4"]) == {"class model"}
    assert costs.fwd_bwd_s_per_sample["T4"] == base.fwd_bwd_s_per_sample["T4"]
    assert costs.fwd_bwd_s_fixed["T4"] == base.fwd_bwd_s_fixed["T4"]
    assert costs.fwd_s_per_sample["T4"] == base.fwd_s_per_sample["T4"]
    assert all(t >= 0 for t in costs.fwd_bwd_s_per_sample["cpu-test"])
    # The forward is fitted from the entries' own forward times (issue 32 item 5): the slope of
    # each block's summed fwd_ms between the two micro-batches, within the fwd+bwd slope.
    calls = {n: model_calls(captured, n) for n in (1, 4)}
    for b in range(bg.num_blocks):
        fwd = [sum(entries[calls[n][x].key].fwd_ms for x in bg.block_nodes(b) if x in calls[n]) * 1e-3
               for n in (1, 4)]
        want = min(costs.fwd_bwd_s_per_sample["cpu-test"][b], max(0.0, (fwd[1] - fwd[0]) / 3))
        assert costs.fwd_s_per_sample["cpu-test"][b] == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert costs.fwd_s_fixed["cpu-test"][b] <= costs.fwd_bwd_s_fixed["cpu-test"][b]
    assert sum(costs.fwd_bwd_s_per_sample["cpu-test"]) + sum(costs.fwd_bwd_s_fixed["cpu-test"]) > 0
    assert costs.param_count == base.param_count


def test_bench_kernels_harness_writes_profile(tmp_path, capsys):
    from zorse_fx.cli import main

    out = tmp_path / "cpu.json"
    assert main(["bench", "kernels", "--model", "gpt", "--seq-len", "16", "--batch-sizes", "1,2", "--repeats", "1",
                 "--no-standard", "--device-type", "cpu-test", "-o", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    prof = KernelProfile.load(out)
    assert prof.device.device_type == "cpu-test" and prof.device.backend == "cpu"
    assert {e.op_class for e in prof.entries} >= {"matmul", "attention", "norm", "embedding", "cross_entropy"}
    # The calibration is a timing ratio (whole-model step / sum of replayed
    # nodes) and moves with the machine's load, so only its arithmetic is
    # checked: it is the ratio of the two times the harness printed.
    printed = capsys.readouterr().out
    m = re.search(r"calibration ([0-9.]+) \(gpt batch 2 seq 16: whole ([0-9.]+) ms \(before the nodes ([0-9.]+), "
                  r"after ([0-9.]+)\) / nodes ([0-9.]+) ms\)", printed)
    assert m, printed
    whole, before, after, nodes = (float(m.group(k)) for k in (2, 3, 4, 5))
    assert whole == pytest.approx((before + after) / 2, abs=0.01)  # (each printed to 0.01 ms)
    assert prof.calibration == pytest.approx(whole / nodes, rel=0.02, abs=2e-3)
    assert f"{prof.calibration:.3f}" == m.group(1)
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert "kernel profile: cpu-test" in printed
    # [Note: the measured optimizer step]: the runtime's optimizer phase on the model's own parameters.
    m = re.search(r"optimizer step: ([0-9.]+) ns/param \(gradient norm \+ AdamW on gpt's parameters after its "
                  r"backward\)", printed)
    assert m, printed
    assert f"{prof.optimizer_ns_per_param:.2f}" == m.group(1)
    assert "optimizer: gradient norm + AdamW on gpt's parameters after its backward" in prof.notes


def test_optimizer_step_is_timed_after_each_backward_on_the_models_parameters():
    """With a model, every timed step follows one forward and backward, and AdamW steps the model's own
    parameters (the first step, which creates AdamW's state, untimed)."""
    from zorse_fx.profiling.kernels_main import measure_optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, block_size=8))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 64, (2, 8))
    ns = measure_optimizer(torch.device("cpu"), model=model, batch=(ids, ids), samples=3)
    assert len(calls) == 4 and math.isfinite(ns) and ns > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt", "--batch-sizes", "1"],
     "--batch-sizes 1: the model sweep needs two or more micro-batch sizes (each node's time is fitted between the "
     "smallest and the largest), e.g. --batch-sizes 1,4"),
    (["--batch-sizes", "1"],
     "--batch-sizes 1: the `fake` replay's calibration runs --calibrate 'gpt' whole at the largest micro-batch "
     "size, which must be >= 2 (capture keeps the batch dimension symbolic); e.g. --batch-sizes 1,4, or "
     "--calibrate '' to skip it"),
    (["--model", "gpt", "--batch-sizes", "0,4"],
     "--batch-sizes '0,4': give micro-batch sizes, integers >= 1 separated by commas, e.g. --batch-sizes 1,4"),
    (["--model", "gpt", "--batch-sizes", "4,4"],
     "--batch-sizes '4,4': micro-batch sizes given twice; give each once, e.g. --batch-sizes 1,4"),
    (["--model", "gpt", "--seq-len", "64k"],
     "--seq-len '64k': give sequence lengths, integers >= 1 separated by commas, e.g. --seq-len 64,256"),
    (["--model", "gtp"], "--model 'gtp': unknown model; use one of smollm2-135m, gpt2-124m, gpt, "),
    (["--model", "gpt", "--layers", "2"], "--layers applies to the published models ("),
    (["--model", "llama2-7b", "--layers", "0"], "--layers 0: give the decoder layers to keep, an integer >= 1"),
    (["--repeats", "0"], "--repeats 0: give an integer >= 1"),
    (["--threads", "0"], "--threads 0: give an integer >= 1"),
    (["--flush-bytes", "-1"], "--flush-bytes -1: give an integer >= 0"),
    (["--cpu-scale", "0"], "--cpu-scale 0.0: give a scale > 0 of the standard shapes (default 0.25)"),
    (["--precision", "fp8"], "--precision 'fp8': use one of fp32, bf16-mixed, fp16-mixed"),
    (["--model", "gpt", "--report", "r.json"],
     "--report applies to the `graph` replay (this one is `fake`: the default on a CPU); add --replay graph or "
     "drop --report"),
    (["--model", "gpt", "--replay", "graph", "--seq-len", "16,32", "--calibrate-at", "64,1"],
     "--calibrate-at 64,1: not a measured point; give SEQ from --seq-len (16,32) and MICRO_BATCH from "
     "--batch-sizes (1,8)"),
    (["--model", "gpt", "--replay", "graph", "--calibrate-at", "64"],
     "--calibrate-at '64': give SEQ,MICRO_BATCH, e.g. --calibrate-at 4096,1"),
    (["--no-standard"], "nothing to measure: give --model, or drop --no-standard"),
    (["--min-window-ms", "-5"], "--min-window-ms -5.0: give milliseconds >= 0 (0: one call per sample)"),
    (["--min-window-ms", "nan"], "--min-window-ms nan: give milliseconds >= 0 (0: one call per sample)"),
])
def test_bench_kernels_batch_sizes_1_refused(tmp_path, capsys, argv, message):
    """`zorse bench kernels --batch-sizes 1` failed after the whole sweep
    (165 s) naming an internal argument (example_inputs[0]); every option is
    now checked before anything is loaded: one line naming the flag, exit 2."""
    from zorse_fx.cli import main

    if torch.cuda.is_available():
        pytest.skip("the messages name the CPU's default replay (`fake`)")
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", *argv, "-o", str(tmp_path / "p.json")])
    assert e.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"zorse bench kernels: error: {message}"), last
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(SystemExit):  # `python -m zorse_fx.profiling.kernels_main` checks the same
        __import__("zorse_fx.profiling.kernels_main", fromlist=["main"]).main([*argv, "-o", str(tmp_path / "p.json")])
    assert capsys.readouterr().err.splitlines()[-1] == last


def test_bench_kernels_output_directory_refused(tmp_path, capsys):
    from zorse_fx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--model", "gpt", "--batch-sizes", "1,2", "-o", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zorse bench kernels: error: -o {tmp_path}: is a directory; give the file to write, e.g. "
        f"-o {tmp_path / 'profile.json'}")


def test_planner_uses_profile_for_profiled_types(tmp_path):
    """A cluster of a profiled device type is priced from the profile."""
    import zorse_fx as zorse

    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: c\n"
        "gpu_types:\n"
        "  cpu-test: {memory_GiB: 4, mem_bw_GBps: 10, fp32_tflops: 0.1, fp16_tensor_tflops: 0.1,"
        " bf16_supported: true, source: 'test'}\n"
        "nodes:\n  - name: n0\n    gpus: [{type: cpu-test, count: 2}]\n"
        "links:\n  intra_node: {bandwidth_GBps: 3, latency_us: 50}\n"
    )
    ids = torch.randint(0, 256, (2, T))
    prof = _profile("cpu-test", "cpu", [_timing(f"x{i}", c, 0.01, 0.02, 1e6, 1e5) for i, c in
                                        enumerate(("matmul", "attention", "norm", "elementwise", "embedding",
                                                   "cross_entropy", "copy"))])
    path = prof.save(tmp_path / "cpu-test.json")
    model = zorse.compile(GPT(GPTConfig(n_layer=2, n_embd=32, block_size=T)), cluster=cluster,
                          example_inputs=(ids, ids), global_batch_size=4, profiles=(str(path),), solver_budget=2.0)
    assert model.plan.predicted_step_time_s > 0


def test_matmul_flops_use_the_contracted_dim():
    from zorse_fx.cost.opclass import flops_bytes

    bias, a, b, out = torch.empty(3072), torch.empty(256, 768), torch.empty(768, 3072), torch.empty(256, 3072)
    assert flops_bytes("matmul", [bias, a, b], [out])[0] == 2 * 256 * 3072 * 768  # addmm(bias, a, b)
    x, w = torch.empty(4, 64, 576), torch.empty(1536, 576)
    assert flops_bytes("matmul", [x, w], [torch.empty(4, 64, 1536)])[0] == 2 * 4 * 64 * 1536 * 576  # linear


def test_timing_window_makes_each_sample_the_mean_of_calls_filling_it(monkeypatch):
    """[Note: timing windows]: by default a sample is one call; inside ``timing_window(ms)`` it is the mean
    over the back-to-back calls made until ``ms`` has passed. A fake clock that advances 2 ms per call (a
    real one under a CPU quota is the point, but no test asserts timing) makes the counts exact: 10 ms ->
    5 calls per sample, 3 samples, + the warm-up call."""
    from zorse_fx.cost import replay

    now = [0.0]
    calls = []

    def fn():
        calls.append(now[0])
        now[0] += 2e-3

    monkeypatch.setattr(replay.time, "perf_counter", lambda: now[0])
    cpu = torch.device("cpu")
    assert replay._timeit(fn, cpu, 3) == pytest.approx(2.0) and len(calls) == 1 + 3
    calls.clear()
    with replay.timing_window(10):
        assert replay._timeit(fn, cpu, 3) == pytest.approx(2.0)
    assert len(calls) == 1 + 3 * 5
    calls.clear()
    replay._timeit(fn, cpu, 3)
    assert len(calls) == 1 + 3  # the window ends with the block
    with pytest.raises(ValueError, match="timing window -1 ms: give a number >= 0"):
        with replay.timing_window(-1):
            pass
