"""The memory flags ([Note: memory flags] in ``zorse_fx/options.py``) mean one
thing to every planner (issue 46): each combination of ``sharding``,
``grad_sharding``, ``param_sharding``, ``offload``, ``activation_offload`` and
``recompute`` is either refused up front in one line naming the two flags and
why, or planned by every planner ("auto" = the portfolio, "cpsat", "grouped",
"stage_dp", "brute_force") into a plan that honours every "always" and every
"never" -- checked here on the plan's own fields, not through the evaluator's
``mode_violations`` (which is also checked, as ``feasible``).

The instance: two GPUs of one type on one node with host memory, a 3-block
model that fits either way, one stage on both GPUs (``max_stages=1``,
``allow_idle_gpus=False``), so every ZeRO level applies to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from conftest import TEST_TIME_LIMIT_S, make_devices
from zorse_fx.cli import main
from zorse_fx.cluster import Cluster
from zorse_fx.errors import InfeasiblePlanError, PlanOptionsError
from zorse_fx.ir.costs import BlockCosts
from zorse_fx.options import MEMORY_MODES, PLANNERS, PlanOptions
from zorse_fx.planner import check_host_memory, solve_plan
from zorse_fx.solve.objective import evaluate

GiB = 2**30
FLAGS = ("sharding", "grad_sharding", "param_sharding", "offload", "activation_offload", "recompute")


def _instance():
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01, 0.02, 0.01)}, param_count=(2_000_000,) * 3,
                       act_bytes_per_sample=(4_000_000,) * 3, cut_bytes_per_sample=(0, 1e6, 1e6, 0))
    devices = make_devices(["A", "A"], ["n0", "n0"], [16 * GiB] * 2, [900e9] * 2)
    devices = dataclasses.replace(devices, host_memory_bytes=(64 * GiB,) * 2, host_mem_bw_bytes_per_s=(100e9,) * 2,
                                  host_link_bytes_per_s=(16e9,) * 2)
    return costs, devices


def _options(planner="auto", **flags) -> PlanOptions:
    return PlanOptions(global_batch_size=2, max_stages=1, num_microbatches=(1,), allow_idle_gpus=False,
                       max_interleave=1, solver_budget=1.0, time_limit_s=TEST_TIME_LIMIT_S, planner=planner, jobs=1,
                       **flags)


def _conflict(flags: dict) -> set[frozenset]:
    """The pairs of flags the runtime's layouts rule out together, derived here from
    the layouts themselves: ZeRO-3 is built on ZeRO-2, ZeRO-2 on ZeRO-1; activation
    offload goes without recomputation and without ZeRO-2/3."""
    bad = set()
    for upper, lowers in (("param_sharding", ("grad_sharding", "sharding")), ("grad_sharding", ("sharding",))):
        for lower in lowers:
            if flags[upper] == "always" and flags[lower] == "never":
                bad.add(frozenset((upper, lower)))
    for other in ("recompute", "grad_sharding", "param_sharding"):
        if flags["activation_offload"] == "always" and flags[other] == "always":
            bad.add(frozenset(("activation_offload", other)))
    return bad


def _effective(flags: dict) -> dict:
    """What the flags ask of the one stage (of two GPUs), per technique: True (must),
    False (must not) or None (the planner's choice)."""
    want = {name: {"always": True, "never": False, "auto": None}[flags[name]] for name in FLAGS}
    if want["param_sharding"]:
        want["grad_sharding"] = True
    if want["grad_sharding"]:
        want["sharding"] = True
    if want["activation_offload"]:
        want["recompute"] = want["grad_sharding"] = want["param_sharding"] = False
    if want["sharding"] is False:
        want["grad_sharding"] = False
    if want["grad_sharding"] is False:
        want["param_sharding"] = False
    return want


def _combinations():
    """Every combination of the six flags' values: (flags, the refused pairs)."""
    for values in itertools.product(MEMORY_MODES, repeat=len(FLAGS)):
        flags = dict(zip(FLAGS, values))
        yield flags, _conflict(flags)


def test_every_memory_flag_combination_is_refused_in_one_line_or_means_what_it_says():
    """All 729 combinations: a conflicting one raises PlanOptionsError, one line that
    names one of its conflicting pairs with both values and zorse plan's flags; any
    other is accepted, with what an "always" implies set (ZeRO-3 -> ZeRO-2 -> ZeRO-1;
    activation offload -> no recomputation, no ZeRO-2/3) and nothing else changed."""
    refused = accepted = 0
    for flags, bad in _combinations():
        if bad:
            with pytest.raises(PlanOptionsError) as e:
                _options(**flags)
            msg = str(e.value)
            m = re.fullmatch(r"PlanOptions\.(\w+)='always' \(zorse plan --([\w-]+) always\) with (\w+)='(\w+)' "
                             r"\(zorse plan --([\w-]+) (\w+)\): .+; set .+ to 'auto'.*", msg)
            assert m and "\n" not in msg, msg
            a, a_flag, b, b_value, b_flag, b_value2 = m.groups()
            assert frozenset((a, b)) in bad and flags[b] == b_value == b_value2, (flags, msg)
            assert (a_flag, b_flag) == (a.replace("_", "-"), b.replace("_", "-"))
            refused += 1
            continue
        got = _options(**flags)
        want = _effective(flags)
        for name in FLAGS:
            expect = {True: "always", False: "never", None: flags[name]}[want[name]]
            assert getattr(got, name) == expect, (flags, name, getattr(got, name))
        accepted += 1
    assert (refused, accepted) == (297, 432)


def _honours(decision, want: dict) -> list[str]:
    """Where the decision's own fields break ``want`` (``_effective``)."""
    mem = decision.memory
    fields = {"sharding": [m.zero >= 1 for m in mem], "grad_sharding": [m.zero >= 2 for m in mem],
              "param_sharding": [m.zero == 3 for m in mem], "offload": [m.optimizer == "host" for m in mem],
              "activation_offload": [m.activations == "host" for m in mem], "recompute": [m.recompute for m in mem]}
    return [f"{name}: wanted {want[name]}, got {fields[name]}" for name in FLAGS
            if want[name] is not None and any(bool(x) != want[name] for x in (fields[name] or (False,)))]


@pytest.mark.parametrize("planner", PLANNERS)
def test_every_accepted_memory_flag_combination_is_honoured_by_every_planner(planner):
    """Issue 46: ``--param-sharding always``, ``--grad-sharding always`` alone or
    ``--offload always`` ended the default planner in an AssertionError (CP-SAT's
    model has no ZeRO-2/3 nor offload), and ``--planner stage_dp`` returned plans
    without ZeRO at all. Now every accepted combination (deduplicated by what the
    options mean after their implications) gets a feasible plan from every
    planner, and the plan's stage has exactly the techniques an "always" asks and
    none a "never" forbids."""
    costs, devices = _instance()
    seen = set()
    for flags, bad in _combinations():
        if bad:
            continue
        opts = _options(planner, **flags)
        key = tuple(getattr(opts, name) for name in FLAGS)
        if key in seen:
            continue
        seen.add(key)
        res = solve_plan(costs, devices, opts)
        d = res.decision
        assert d.stage_gpus == ((0, 1),), (flags, d)
        assert not _honours(d, _effective(flags)), (flags, _honours(d, _effective(flags)), res.status)
        ev = evaluate(costs, devices, opts, d)
        assert ev.feasible, (flags, ev.violations)
    # every distinct meaning tried once (the test's own derivation of the implications)
    assert len(seen) == len({tuple(_effective(f).values()) for f, bad in _combinations() if not bad})


def test_grad_sharding_always_alone_gives_zero2_not_an_assertion():
    """The issue's first case on the default planner: ``grad_sharding="always"`` alone
    (``sharding`` left "auto") is ZeRO-2 on the stage, from the heuristics (CP-SAT's
    model cannot plan it, so it does not run), not ``AssertionError: CP-SAT objective
    ... != evaluate()``; and ``solve_cpsat`` called on its own refuses it in one line."""
    from zorse_fx.solve import solve_cpsat

    costs, devices = _instance()
    lines = []
    res = solve_plan(costs, devices, _options("auto", grad_sharding="always"), progress=lines.append)
    assert res.decision.memory[0].zero == 2
    assert res.status.startswith("STAGE_DP") and "OPTIMAL" not in res.status
    assert any("CP-SAT not run: grad_sharding='always' asks for what its model does not have" in x for x in lines)
    with pytest.raises(PlanOptionsError, match=r"^CP-SAT alone cannot plan grad_sharding='always': its model has "
                                               r"ZeRO-1 and recomputation only .*planner 'stage_dp'\)$"):
        solve_cpsat(costs, devices, _options("cpsat", grad_sharding="always"))


def test_stage_dp_never_returns_a_plan_without_the_zero_asked_for():
    """The issue's ``--planner stage_dp`` case: with two stages allowed, a plan of
    one-GPU stages would need no ZeRO at all; the stage DP's plan under
    ``param_sharding="always"`` has ZeRO-3 on every stage of two or more GPUs
    (and every such stage is ZeRO-1/2 too)."""
    costs, devices = _instance()
    opts = dataclasses.replace(_options("stage_dp", param_sharding="always"), max_stages=2, allow_idle_gpus=True)
    d = solve_plan(costs, devices, opts).decision
    multi = [s for s, g in enumerate(d.stage_gpus) if len(g) >= 2]
    assert all(d.memory[s].zero == 3 for s in multi)
    assert evaluate(costs, devices, opts, d).feasible


def test_no_plan_for_an_always_says_which_flag_and_why():
    """Where nothing honours an "always" (16 GB of optimizer state per GPU even
    offloaded: 1 GiB of host memory), the portfolio's error names the flag and the
    stage DP's reason, in one line."""
    costs, devices = _instance()
    small = dataclasses.replace(devices, host_memory_bytes=(2**20,) * 2)
    big = dataclasses.replace(costs, param_count=(1_000_000_000,) * 3)
    with pytest.raises(InfeasiblePlanError) as e:
        solve_plan(big, small, _options("auto", offload="always"))
    msg = str(e.value)
    assert msg.startswith("no plan honours offload='always': the stage DP (the planner that has ZeRO-2/3 and "
                          "offload) ") and "\n" not in msg, msg


def _cluster(tmp_path, host: bool):
    text = ("name: tiny\nnodes:\n  - name: n0\n    gpus: [{type: T4, count: 2}]\n"
            + ("    host_memory_GiB: 64\n" if host else "")
            + "  - name: n1\n    gpus: [{type: T4, count: 2}]\n"
            + "links:\n  intra_node: {bandwidth_GBps: 16, latency_us: 10}\n"
            + "  inter_node: {bandwidth_GBps: 3.125, latency_us: 20}\n")
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path


def test_offload_always_without_host_memory_names_the_missing_field(tmp_path, capsys):
    """The issue's ``--offload always`` on a cluster file without ``host_memory_GiB``
    said "needs 0.0 GiB ... largest GPU has 36.0 GiB usable"; now ``zorse plan``
    refuses it before capturing the model, in one line naming the file, the flag and
    the field to add (exit 1), for activation offload too; with host memory on one
    node of two, only ``--use-all-gpus`` is refused (the other node's GPUs cannot
    offload)."""
    none = _cluster(tmp_path, host=False)
    argv = ["plan", "--model", "gpt", "--cluster", str(none), "--global-batch-size", "4", "--seq-len", "16",
            "-o", str(tmp_path / "out")]
    assert main(argv + ["--offload", "always"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"zorse: {none}: offload='always' (zorse plan --offload always) keeps every stage's optimizer "
                   f"state in host memory, but no node gives host_memory_GiB: add host_memory_GiB (the GiB of RAM "
                   f"training may use on that node, e.g. host_memory_GiB: 512) to the nodes, or set offload to "
                   f"'auto'"), err
    assert main(argv + ["--activation-offload", "always"]) == 1
    assert "activation_offload='always' (zorse plan --activation-offload always) keeps every stage's saved " \
           "activations in host memory, but no node gives host_memory_GiB" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    half = Cluster.from_yaml(_cluster(tmp_path, host=True))
    check_host_memory(half, PlanOptions(global_batch_size=4, offload="always"))  # n1 may stay idle
    with pytest.raises(PlanOptionsError, match=r"tiny.yaml: offload='always' .* with every GPU in use .*: node n1 "
                                               r"gives no host_memory_GiB, so its GPUs cannot host an offloading "
                                               r"stage; add host_memory_GiB there, or allow idle GPUs$"):
        check_host_memory(half, PlanOptions(global_batch_size=4, offload="always", allow_idle_gpus=False))


def test_refused_flag_combination_exits_before_the_model_is_captured(tmp_path, capsys):
    """``zorse plan --param-sharding always --grad-sharding never``: refused as a usage error of the typed
    command line (PlanOptions' own check), one line naming both flags, exit 2, nothing written."""
    argv = ["plan", "--model", "gpt", "--cluster", str(_cluster(tmp_path, host=True)), "--global-batch-size", "4",
            "--seq-len", "16", "-o", str(tmp_path / "out"), "--param-sharding", "always", "--grad-sharding", "never"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(
        "zorse plan: error: PlanOptions.param_sharding='always' (zorse plan --param-sharding always) with "
        "grad_sharding='never' (zorse plan --grad-sharding never): ZeRO-3 shards the weights of a ZeRO-2 stage"), err
    assert not (tmp_path / "out").exists()
