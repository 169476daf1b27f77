"""A plan is data, checked before anything runs (issue 12): plan.json against
its schema (``plan_schema``) and the cross-field rules, weights per tensor
before they are copied into a stage, and messages that quote a value cut to a
readable length (a YAML alias bomb in a cluster field), and JSON / YAML nested
deeper than 100 levels in any file zorse_fx reads (issue 46). Every test
asserts the message: the file, the field path, the value and the fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import CLUSTERS, edit_plan_json as _edited, plan_load_error as _load_error
from test_plan import _gpt_plan, exported  # noqa: F401 (exported: a fixture, of this file's plan)
from zorse_fx.cli import main as zorse_main
from zorse_fx.cluster import Cluster
from zorse_fx.errors import ClusterConfigError, PlanFileError, WeightsFileError, short_repr
from zorse_fx.plan import PLAN_FORMAT_VERSION, Plan
from zorse_fx.precision import precision_policy

REEXPORT = "re-export the plan with `zorse plan`"


@pytest.fixture(scope="module")
def plan():
    """Stage 0: GPUs 0, 1 (ranks 0, 1) taking 3 + 1 samples; stage 1: GPU 2 (rank 2) taking 4."""
    return _gpt_plan(2, (3,), ((0, 1), (2,)), ((3, 1), (4,)))


# -- shares and other fields: type and range -------------------------------------------------

@pytest.mark.parametrize(("value", "reason"), [
    (0, "expected `int` >= 1"),
    (-2, "expected `int` >= 1"),
    (5.5, "expected `int`, got `float`"),
    ("3", "expected `int`, got `str`"),
    (True, "expected `int`, got `bool`"),
])
def test_a_bad_share_is_named(exported, value, reason):
    path = _edited(exported, lambda d: d["stages"][1]["gpus"][0].update(samples_per_microbatch=value))
    assert _load_error(path) == (
        f"{path}: field stages[1].gpus[0].samples_per_microbatch is {value!r}: {reason} (the samples this GPU takes "
        f"from every micro-batch; the shares of a stage's GPUs sum to microbatch_size); correct it or {REEXPORT}")


@pytest.mark.parametrize(("edit", "field", "value", "reason"), [
    (lambda d: d.update(seq_len="16"), "'seq_len'", "'16'", "expected `int`, got `str`"),
    (lambda d: d.update(seq_len=-16), "'seq_len'", "-16", "expected `int` >= 1 (tokens per sample)"),
    (lambda d: d.update(global_batch_size=None), "'global_batch_size'", "None", "expected `int`, got `null`"),
    (lambda d: d.update(num_microbatches=0), "'num_microbatches'", "0", "expected `int` >= 1"),
    (lambda d: d["stages"][0]["gpus"][1].update(rank=1.0), "stages[0].gpus[1].rank", "1.0",
     "expected `int`, got `float`"),
    (lambda d: d["stages"][1]["gpus"][0].update(gpu=-1), "stages[1].gpus[0].gpu", "-1", "expected `int` >= 0"),
    (lambda d: d["stages"][0].update(blocks=[0]), "stages[0].blocks", "[0]", "expected `array` of length 2, got 1"),
    (lambda d: d["stages"][0].update(label=None), "stages[0].label", "None", "expected `str`, got `null`"),
    (lambda d: d["stages"][0]["params"].update({"w": 3}), "stages[0].params['w']", "3",
     "expected `str`, got `int`"),
    (lambda d: d["stages"][1]["recv"][0].update(shape_per_sample="16x32"), "stages[1].recv[0].shape_per_sample",
     "'16x32'", "expected `array`, got `str`"),
    (lambda d: d["solver"].update(wall_s="fast"), "solver.wall_s", "'fast'", "expected `float`, got `str`"),
    (lambda d: d.update(stages={}), "'stages'", "{}", "expected `array`, got `object`"),
])
def test_a_wrong_type_or_range_names_the_field_path_and_value(exported, edit, field, value, reason):
    path = _edited(exported, edit)
    message = _load_error(path)
    assert message.startswith(f"{path}: field {field} is {value}: {reason}"), message
    assert message.endswith(f"correct it or {REEXPORT}")


@pytest.mark.parametrize(("edit", "field", "value", "allowed"), [
    (lambda d: d.update(precision="fp8"), "'precision'", "'fp8'", "'fp32', 'bf16-mixed', 'fp16-mixed'"),
    (lambda d: d.update(schedule="zb-h1"), "'schedule'", "'zb-h1'", "'1f1b', 'gpipe'"),
    (lambda d: d.update(label_mode=1), "'label_mode'", "1", "'same', 'shifted'"),
    (lambda d: d["stages"][1]["recv"][0].update(dtype="float33"), "stages[1].recv[0].dtype", "'float33'",
     "'float64', 'float32', 'float16', 'bfloat16'"),
])
def test_an_unknown_enum_value_lists_the_allowed_ones(exported, edit, field, value, allowed):
    path = _edited(exported, edit)
    assert _load_error(path).startswith(f"{path}: field {field} is {value}; allowed: {allowed}")


def test_unknown_and_missing_fields_are_named(exported):
    path = _edited(exported, lambda d: d["stages"][0].update(shraded=True))
    assert _load_error(path) == (f"{path}: unknown field stages[0].shraded (value True); did you mean 'sharded'? "
                                 f"remove it or {REEXPORT}")
    path = _edited(exported, lambda d: (d["stages"][0].pop("shraded"), d["stages"][1]["gpus"][0].pop("node")))
    assert _load_error(path) == f"{path}: missing field stages[1].gpus[0].node; {REEXPORT}"


def test_a_plan_file_that_is_a_list_is_refused(exported):
    (exported / "plan.json").write_text("[1, 2]")
    assert _load_error(exported) == (f"{exported / 'plan.json'}: a plan file holds a JSON object, not a list; "
                                     f"{REEXPORT}")
    with pytest.raises(PlanFileError, match=r"^<dict>: a plan file holds a JSON object, not a list"):
        Plan.from_dict([1, 2])


def test_a_huge_value_is_quoted_short(exported):
    path = _edited(exported, lambda d: d.update(seq_len=["x" * 1000] * 1000))
    message = _load_error(path)
    assert message.startswith(f"{path}: field 'seq_len' is ['xxxx") and "...: expected `int`, got `array`" in message
    assert len(message) < 400


# -- cross-field rules ------------------------------------------------------------------------------

def test_ranks_that_are_not_a_permutation_are_named(exported):
    def swap(d):
        d["stages"][0]["gpus"][1]["rank"], d["stages"][1]["gpus"][0]["rank"] = 2, 1

    path = _edited(exported, swap)
    assert _load_error(path) == (
        f"{path}: field stages[0].gpus[1].rank is 2, expected 1: ranks must be 0..2 node by node (rank_order 'node': "
        f"in the order of the GPUs' 'gpu' index in the cluster file), got [0, 2, 1]; renumber them or {REEXPORT}")
    path = _edited(exported, lambda d: (swap(d), d.update(rank_order="stage")))  # a plan numbered stage by stage
    assert _load_error(path) == (
        f"{path}: field stages[0].gpus[1].rank is 2, expected 1: ranks must be 0..2 in stage order (stage 0's GPUs "
        f"first, a permutation of the world), got [0, 2, 1]; renumber them or {REEXPORT}")
    def duplicate(d):
        d["stages"][0]["gpus"][1]["rank"], d["stages"][1]["gpus"][0]["rank"] = 1, 0

    path = _edited(exported, duplicate)
    assert "field stages[1].gpus[0].rank is 0, expected 2: ranks must be 0..2" in _load_error(path)
    path = _edited(exported, lambda d: d.update(rank_order="gpu"))
    assert _load_error(path) == f"{path}: field 'rank_order' is 'gpu'; allowed: 'node', 'stage'"


def test_shares_that_do_not_sum_to_the_microbatch_are_named(exported):
    path = _edited(exported, lambda d: d["stages"][0]["gpus"][0].update(samples_per_microbatch=2))
    assert _load_error(path) == (
        f"{path}: field stages[0].gpus[*].samples_per_microbatch: stage 0 GPUs take [2, 1] samples (sum 3) but "
        f"microbatch_size is 4; the shares of a stage's GPUs must sum to it")


def test_stage_index_and_block_ranges_are_checked(exported):
    path = _edited(exported, lambda d: d["stages"][1].update(index=3))
    assert _load_error(path) == (f"{path}: field stages[1].index is 3, expected 1: stages are listed in order, "
                                 f"numbered from 0; {REEXPORT}")
    path = _edited(exported, lambda d: d["stages"][1].update(index=1, blocks=[4, 5]))
    assert _load_error(path) == (
        f"{path}: field stages[1].blocks is [4, 5]: a stage's blocks are [start, end) with start < end and the "
        f"stages' ranges contiguous, so it must start at block 3 (where stages[0] ends); {REEXPORT}")
    path = _edited(exported, lambda d: d["stages"][1].update(blocks=[3, 3]))
    assert f"field stages[1].blocks is [3, 3]: a stage's blocks are [start, end) with start < end" in \
        _load_error(path)
    assert "so it must end after it starts" in _load_error(path)


def test_zorse_show_prints_one_line_and_exits_1(exported, capsys):
    path = _edited(exported, lambda d: d["stages"][1]["gpus"][0].update(samples_per_microbatch=0))
    assert zorse_main(["show", str(exported)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"zorse: {path}: field stages[1].gpus[0].samples_per_microbatch is 0: expected `int` "
                            f">= 1 (the samples this GPU takes from every micro-batch; the shares of a stage's GPUs "
                            f"sum to microbatch_size); correct it or {REEXPORT}\n")


def test_older_versions_still_load(plan, exported):
    """Versions 1-4 lack fields added since; they load with the values they trained with."""
    def to_v1(d):
        d["version"] = 1
        for key in ("interleave", "precision", "grad_reduce_dtype", "grad_bucket_bytes"):
            del d[key]
        for s in d["stages"]:
            del s["sharded"], s["recompute"], s["source_sha256"]
            for g in s["gpus"]:
                del g["state_shard_bytes"]
        for key in ("simulated_step_time_s", "simulated_max_memory_fraction", "simulated_bubble_fraction"):
            del d["solver"][key]

    old = Plan.load(_edited(exported, to_v1))
    assert (old.interleave, old.precision, old.grad_reduce_dtype) == (1, "fp32", "float32")
    assert old.stages == plan.stages and not old.sources_verified
    assert old.grad_bucket_bytes == 25 * 2**20 and old.to_dict()["version"] == PLAN_FORMAT_VERSION


def test_a_version_5_file_reads_with_25_mib_buckets(exported):
    """Version 6 added ``grad_bucket_bytes``; a version-5 file's runtime used 25 MiB unless told otherwise."""
    def to_v5(d):
        d["version"] = 5
        del d["grad_bucket_bytes"]

    old = Plan.load(_edited(exported, to_v5))
    assert old.grad_bucket_bytes == 25 * 2**20 and old.sources_verified


def test_a_bucket_size_below_1_kib_is_named(exported):
    path = _edited(exported, lambda d: d.update(grad_bucket_bytes=512))
    assert _load_error(path) == (f"{path}: field 'grad_bucket_bytes' is 512: expected `int` >= 1024 (the gradient "
                                 f"all-reduce bucket size in bytes, at least 1 KiB (zorse plan --bucket-mib)); "
                                 f"correct it or {REEXPORT}")


def test_the_schema_is_the_dataclasses():
    """plan.json's structs are built from the records' dataclasses: the same fields in the same
    order, plus the three plan.json adds; a field is declared once (``file_schema.struct_of``)."""
    import dataclasses

    import msgspec

    from zorse_fx.ir.tensor import TensorSpec
    from zorse_fx.plan import GPUShare, MemoryBreakdown, SolverReport, StagePlan
    from zorse_fx.plan_schema import GPUShareDoc, MemoryBreakdownDoc, PlanDoc, SolverDoc, StageDoc, TensorSpecDoc

    def names(cls):
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("file") != "no"]

    def doc_names(doc):
        return [f.name for f in msgspec.structs.fields(doc)]

    for cls, doc in [(GPUShare, GPUShareDoc), (SolverReport, SolverDoc), (TensorSpec, TensorSpecDoc),
                     (MemoryBreakdown, MemoryBreakdownDoc)]:
        assert doc_names(doc) == names(cls)
    stage = names(StagePlan)
    assert doc_names(StageDoc) == [*stage[:stage.index("source_file") + 1], "source_sha256",
                                   *stage[stage.index("source_file") + 1:]]
    top = names(Plan)
    assert doc_names(PlanDoc) == ["format", *top[:top.index("grad_reduce_dtype") + 1], "compute_dtype",
                                  *top[top.index("grad_reduce_dtype") + 1:]]


# -- weights, per tensor -------------------------------------------------------------------------------

def _runtime(exported, weights):
    from zorse_fx.runtime.stage import StageRuntime

    return StageRuntime(Plan.load(exported), 0, exported, weights, rank=0, device=torch.device("cpu"),
                        precision=precision_policy("fp32"), weights_source=str(exported / "weights.pt"))


def _stage0_weight(exported, weights, ndim):
    """The canonical name of a stage-0 weight with ``ndim`` dimensions."""
    return next(c for c in Plan.load(exported).stages[0].params.values() if weights[c].dim() == ndim)


def test_a_weight_of_the_wrong_shape_is_not_broadcast(exported):
    weights = torch.load(exported / "weights.pt", weights_only=True)
    assert _runtime(exported, weights).module is not None  # the exported weights fit
    name = _stage0_weight(exported, weights, 2)
    shape = tuple(weights[name].shape)
    weights[name] = weights[name][:1].clone()  # (1, n): copy_ would broadcast it over every row
    with pytest.raises(WeightsFileError) as e:
        _runtime(exported, weights)
    assert str(e.value) == (
        f"{exported / 'weights.pt'}: tensor {name!r} has shape {(1, shape[1])}, torch.float32 but stage 0 expects "
        f"shape {shape}, torch.float32; these are not the weights of the model the plan was made for: export them "
        f"with the plan (`zorse plan` writes weights.pt, CompiledModel.save_weights) from that model, in its dtypes")


def test_a_weight_of_the_wrong_dtype_is_named(exported):
    weights = torch.load(exported / "weights.pt", weights_only=True)
    name = _stage0_weight(exported, weights, 1)
    shape = tuple(weights[name].shape)
    weights[name] = weights[name].half()
    with pytest.raises(WeightsFileError, match=re.escape(
            f"weights.pt: tensor {name!r} has shape {shape}, torch.float16 but stage 0 expects shape {shape}, "
            f"torch.float32; these are not the weights")):
        _runtime(exported, weights)


def test_a_missing_weight_is_named(exported):
    weights = torch.load(exported / "weights.pt", weights_only=True)
    name, other = _stage0_weight(exported, weights, 2), _stage0_weight(exported, weights, 1)
    shape = tuple(weights.pop(name).shape)
    weights[other] = torch.zeros(3)  # a second misfit: counted
    with pytest.raises(WeightsFileError) as e:
        _runtime(exported, weights)
    assert str(e.value).startswith(f"{exported / 'weights.pt'}: no tensor {name!r}, which stage 0 needs (shape "
                                   f"{shape}, torch.float32) (and 1 more tensors do not fit); these are not the "
                                   f"weights of the model the plan was made for")
    with pytest.raises(WeightsFileError, match=r"weights.pt: holds a list, not a dict canonical name -> tensor"):
        _runtime(exported, [1, 2])
    assert isinstance(e.value, ValueError)  # a user input error (errors.py's policy)


# -- messages quote values short: a YAML alias bomb ------------------------------------------------

def _alias_bomb(levels: int = 9) -> str:
    """Billion laughs in YAML flow style: level k is a list of 9 aliases of level k - 1 (9^9 strings)."""
    parts = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    parts += [f"&a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def test_a_yaml_alias_bomb_in_a_cluster_field_is_refused_promptly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"name: {_alias_bomb()}\nnodes: [{{name: n0, gpus: [{{type: T4, count: 1}}]}}]\n")
    with pytest.raises(ClusterConfigError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    assert message.startswith(f"{path}: refused YAML aliases at line 1, column ")
    assert "the aliases (*name) expand this value to more than 100,000 values (a YAML alias bomb?)" in message
    assert len(message) < 300
    path.write_text("name: &r [a, *r]\nnodes: [{name: n0, gpus: [{type: T4, count: 1}]}]\n")
    with pytest.raises(ClusterConfigError, match="refused YAML aliases at line 1.*an alias refers to a node that "
                                                 "contains it"):
        Cluster.from_yaml(path)
    # Aliases of a normal size still work (a link given once, used twice).
    path.write_text("links:\n  intra_node: &l {bandwidth_GBps: 100, latency_us: 5}\n  inter_node: *l\n"
                    "nodes: [{name: n0, gpus: [{type: T4, count: 1}]}, {name: n1, gpus: [{type: T4, count: 1}]}]\n")
    assert Cluster.from_yaml(path).inter_node_link.bandwidth_bytes_per_s == 100e9


def test_a_shared_reference_bomb_in_a_cluster_field_gives_a_short_message():
    """The same structure given as a dict (no YAML loader to refuse it): the
    message quotes the value cut short instead of building its repr."""
    bomb: object = ["lol"] * 9
    for _ in range(9):
        bomb = [bomb] * 9
    nodes = [{"name": "n0", "gpus": [{"type": "T4", "count": bomb}]}]
    with pytest.raises(ClusterConfigError) as e:
        Cluster.from_dict({"nodes": nodes}, source="c.yaml")
    assert str(e.value) == ("c.yaml: nodes[0].gpus[0].count: must be a positive integer (at most 4096) (got "
                            "[[[[[[[[[['lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol'], ['l...); set it "
                            "to the number of GPUs of this type in the node")


def test_short_repr():
    assert short_repr({"a": (1,), "b": [None, 2.5], "c": set()}) == repr({"a": (1,), "b": [None, 2.5], "c": set()})
    assert short_repr("x" * 100, 10) == "'xxxxxx..."
    assert len(short_repr(list(range(10**6)), 50)) == 50
    loop: list = [1]
    loop.append(loop)
    assert short_repr(loop) == repr(loop) == "[1, [...]]"
    assert short_repr(10**5000) == "<int of 16610 bits>"
    assert short_repr(Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"), 30).endswith("...")


# -- deep nesting: one line naming the file and the limit, no RecursionError (issue 46) ----------

DEEP = 10_000  # nested lists: past Python's recursion limit (json, PyYAML) and pyarrow's C stack


def _deep_json(first_fields: str) -> str:
    """A JSON object of a format's first fields and one value nested ``DEEP`` lists deep."""
    return "{" + first_fields + ', "deep": ' + "[" * DEEP + "]" * DEEP + "}\n"


def _readers(tmp_path):
    """(the file to write, its format, how zorse_fx reads it) for every JSON file format it reads."""
    from zorse_fx.cost.profile import KERNEL_PROFILE_FILE, KernelProfile
    from zorse_fx.plan_schema import PLAN_FILE
    from zorse_fx.profiling.comm import COMM_PROFILE_FILE, CommProfile
    from zorse_fx.runtime.checkpoint import MANIFEST, MANIFEST_FILE, read_manifest
    from zorse_fx.token_data import TOKEN_HEADER_FILE, TokenData
    from zorse_fx.train_options import _options_file, read_options_file

    (tmp_path / "plan").mkdir()
    (tmp_path / "step_2").mkdir()
    (tmp_path / "tokens.bin").write_bytes(b"\0\0")
    return [(tmp_path / "plan" / "plan.json", PLAN_FILE, lambda p: Plan.load(p.parent)),
            (tmp_path / "train_options.json", _options_file(), read_options_file),
            (tmp_path / "step_2" / MANIFEST, MANIFEST_FILE, lambda p: read_manifest(p.parent)),
            (tmp_path / "tokens.json", TOKEN_HEADER_FILE, lambda p: TokenData.open(p.with_suffix(".bin"))),
            (tmp_path / "kernels.json", KERNEL_PROFILE_FILE, KernelProfile.load),
            (tmp_path / "comm.json", COMM_PROFILE_FILE, CommProfile.load)]


def test_deep_json_refused_in_every_file_format(tmp_path):
    """10,000 nested lists in plan.json, train_options.json, a checkpoint
    manifest, a token header, a kernel or a communication profile: the
    format's error naming the file, the line and the limit (was a bare
    RecursionError from json)."""
    for path, fmt, read in _readers(tmp_path):
        path.write_text(_deep_json(f'"format": "{fmt.name}",\n"version": {max(fmt.versions)}'))
        with pytest.raises(fmt.error) as e:
            read(path)
        assert str(e.value) == (f"{path}: values nested more than 100 levels deep (arrays or objects inside each "
                                f"other) at line 2; a {fmt.what} file is a few levels deep: {fmt.remake}"), fmt.name
        assert isinstance(e.value, ValueError)


def test_deep_json_limit_is_100_levels_outside_strings():
    from zorse_fx.file_schema import MAX_NESTING_DEPTH, json_too_deep

    assert MAX_NESTING_DEPTH == 100
    assert json_too_deep(["{\"a\": " + "[" * 99 + "]" * 99 + "}"]) is None  # 100 levels, the object's included
    assert json_too_deep(["{\"a\": ", "[" * 100 + "]" * 100 + "}"]) == 2
    assert json_too_deep(["[1, [2]]"] * 1000) is None  # depth is of nesting, not of the count of brackets
    assert json_too_deep(['{"text": "' + "[" * 500 + '\\" {{{"}']) is None  # brackets in a string, escaped quote
    assert json_too_deep([b'{"text": "[[[["}\n', b"[" * 101 + b"\n"]) == 2  # JSON Lines as bytes


def test_zorse_show_of_a_deep_plan_json_prints_one_line(exported, capsys):
    path = exported / "plan.json"
    lines = path.read_text().splitlines()
    line = next(i for i, ln in enumerate(lines, 1) if '"seq_len": 16' in ln)
    path.write_text(path.read_text().replace('"seq_len": 16', '"seq_len": ' + "[" * DEEP + "]" * DEEP, 1))
    assert zorse_main(["show", str(exported)]) == 1
    assert capsys.readouterr().err == (f"zorse: {path}: values nested more than 100 levels deep (arrays or objects "
                                       f"inside each other) at line {line}; a plan file is a few levels deep: "
                                       f"{REEXPORT}\n")


def test_deep_yaml_cluster_file_refused(tmp_path, capsys):
    """10,000 nested lists in a cluster file, and 60-deep lists chained 40 times
    through aliases (2,400 levels once expanded): one line naming the file,
    the place and the limit (was a RecursionError from PyYAML's composer)."""
    path = tmp_path / "deep.yaml"
    path.write_text("name: deep\nnodes: " + "[" * DEEP + "]" * DEEP + "\n")
    with pytest.raises(ClusterConfigError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == (f"{path}: refused YAML nesting at line 2, column 107: values nested more than 100 levels "
                            f"deep (lists or mappings inside each other); a cluster file is a few levels deep; fix the "
                            f"YAML there")
    chained = "".join(f"x{k}: &x{k} " + "[" * 60 + (f"*x{k - 1}" if k else "1") + "]" * 60 + "\n" for k in range(40))
    path.write_text(chained)
    with pytest.raises(ClusterConfigError, match=r"refused YAML nesting at line 2, column \d+: values nested more "
                                                 r"than 100 levels deep \(lists or mappings inside each other\) once "
                                                 r"its aliases \(\*name\) are expanded; a cluster file is"):
        Cluster.from_yaml(path)
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(path), "--global-batch-size", "4",
                       "-o", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zorse: {path}: refused YAML nesting at line 2") and err.count("\n") == 1
    # 99 lists under the top-level mapping (100 levels) still parse, and reach the cluster checks
    path.write_text("name: ok\nnodes: " + "[" * 99 + "]" * 99 + "\n")
    with pytest.raises(ClusterConfigError, match=r"nodes\[0\]: must be a mapping"):
        Cluster.from_yaml(path)


def test_deep_json_in_run_files_skipped_or_refused(tmp_path):
    """The JSON files a run writes for itself (metrics.jsonl, a rank's error
    record, a heartbeat, an --elastic plan_request.json) nested 10,000 deep, as
    a damaged or foreign file could be: the readers that skip what is not
    theirs skip it, and the plan request is refused in one line; none raises
    the bare RecursionError of json."""
    from zorse_fx.elastic import PLAN_REQUEST, ElasticError, PlanRequest, recorded_cluster_file
    from zorse_fx.runtime.rank_errors import logs_dir, read_rank_errors
    from zorse_fx.runtime.run_dir import METRICS, metrics_run_id
    from zorse_fx.runtime.watchdog import read_heartbeats

    deep = "[" * DEEP + "]" * DEEP
    (tmp_path / METRICS).write_text('{"step": 1, "run_id": "00ff"}\n' + deep + "\n")
    assert metrics_run_id(tmp_path) == "00ff"
    logs_dir(tmp_path).mkdir(parents=True)
    (logs_dir(tmp_path) / "rank0.error.json").write_text(deep)
    assert read_rank_errors(tmp_path) == []
    (tmp_path / "beats").mkdir()
    (tmp_path / "beats" / "rank0").write_text(deep)
    assert read_heartbeats(tmp_path / "beats") == []
    (tmp_path / PLAN_REQUEST).write_text(deep)
    assert recorded_cluster_file(tmp_path) is None
    with pytest.raises(ElasticError, match=rf"^--elastic: {re.escape(str(tmp_path / PLAN_REQUEST))} is not a plan "
                                           r"request `zorse plan` wrote \(maximum recursion depth"):
        PlanRequest.read(tmp_path)
