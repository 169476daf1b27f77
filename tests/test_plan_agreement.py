"""plan.json edits that disagree with the stage files are refused at load
(issue 33 item 6): the stage files' ``SEQ_LEN``, ``MODEL_INPUTS``, ``INPUTS``,
``RECV``, ``SEND``, ``PARAMETERS`` and ``CONSTANTS`` against plan.json
([Note: plan.json agrees with its stage files] in ``zorse_fx/stage_sources.py``),
and a key given twice in one JSON object. Every test asserts the message: the
file, the field, both values and the fix."""

from __future__ import annotations

import json

import pytest

from test_plan import _gpt_plan, exported  # noqa: F401 (exported: a fixture, of this file's plan)
from conftest import edit_plan_json as _edited, plan_load_error as _load_error
from zorse_fx.cli import main as zorse_main
from zorse_fx.stage_sources import stage_declarations

REEXPORT = "re-export the plan with `zorse plan`"
AGREE = "plan.json must agree with its stage files"


@pytest.fixture(scope="module")
def plan():
    """Stage 0: GPUs 0, 1 taking 3 + 1 samples; stage 1: GPU 2 taking 4; 16 tokens per sample."""
    return _gpt_plan(2, (3,), ((0, 1), (2,)), ((3, 1), (4,)))


def test_stage_files_declare_what_plan_json_says(plan):
    decl = stage_declarations(plan.sources[1], 1)
    assert decl["SEQ_LEN"] == plan.seq_len == 16
    assert decl["MODEL_INPUTS"] == list(plan.input_names) == ["idx", "targets"]
    assert decl["INPUTS"] == ["targets"]
    assert decl["RECV"] == [t.to_dict() for t in plan.stages[1].recv]
    assert decl["PARAMETERS"] == plan.stages[1].params


def test_plan_seq_len_edit_disagrees_with_stage_file(exported):
    path = _edited(exported, lambda d: d.update(seq_len=32))
    assert _load_error(path) == (
        f"{path}: field 'seq_len' is 32, but stage_0.py (Stage0.SEQ_LEN) was generated for 16 tokens per sample "
        f"(the shapes its tensors cross the stage boundaries in); {AGREE}: set seq_len back to 16, or plan for 32 "
        f"tokens with `zorse plan --seq-len 32`")


def test_receive_shape_edit_refused(exported):
    path = _edited(exported, lambda d: d["stages"][1]["recv"][0].update(shape_per_sample=[32, 32]))
    assert _load_error(path) == (
        f"{path}: field stages[1].recv[0].shape_per_sample is [32, 32], but stage_1.py "
        f"(Stage1.RECV[0]['shape_per_sample']) was generated for [16, 32]; {AGREE}: set it back to [16, 32], or "
        f"{REEXPORT}")


def test_send_dtype_edit_refused(exported):
    path = _edited(exported, lambda d: d["stages"][0]["send"][0].update(dtype="float16"))
    assert "field stages[0].send[0].dtype is 'float16', but stage_0.py (Stage0.SEND[0]['dtype']) was generated " \
           "for 'float32'" in _load_error(path)


def test_input_names_edit_refused(exported):
    path = _edited(exported, lambda d: d.update(input_names=["input_ids", "targets"]))
    assert _load_error(path) == (
        f"{path}: field 'input_names' is ['input_ids', 'targets'], but stage_0.py (Stage0.MODEL_INPUTS) was "
        f"generated for ['idx', 'targets'] (the model's inputs, in order); {AGREE}: set it back to "
        f"['idx', 'targets'], or {REEXPORT}")
    path = _edited(exported, lambda d: (d.update(input_names=["idx", "targets"]),
                                        d["stages"][0].update(input_names=["targets"])))
    assert _load_error(path) == (
        f"{path}: field stages[0].input_names is ['targets'], but stage_0.py (Stage0.INPUTS) was generated for "
        f"['idx']; {AGREE}: set it back to ['idx'], or {REEXPORT}")


def test_params_edit_refused(exported):
    path = _edited(exported, lambda d: d["stages"][0]["params"].update(wte_weight="lm_head.weight"))
    assert "field stages[0].params['wte_weight'] is 'lm_head.weight', but stage_0.py " \
           "(Stage0.PARAMETERS['wte_weight']) was generated for 'wte.weight'" in _load_error(path)


@pytest.mark.parametrize(("old", "new", "field", "values"), [
    ('"seq_len": 16,', '"seq_len": 16, "seq_len": 32,', "'seq_len'", "(16, then 32)"),
    ('"dtype": "float32"', '"dtype": "float32", "dtype": "float16"', "stages[0].send[0].dtype",
     "('float32', then 'float16')"),
])
def test_duplicate_json_key_refused(exported, old, new, field, values):
    path = exported / "plan.json"
    text = json.dumps(json.loads(path.read_text()))
    assert old in text
    path.write_text(text.replace(old, new, 1))
    assert _load_error(path) == (
        f"{path}: field {field} is given twice {values}; JSON keeps only the last, so the file is refused: delete "
        f"one of the two, or {REEXPORT}")


def test_zorse_show_refuses_an_edited_plan_in_one_line(exported, capsys):
    path = _edited(exported, lambda d: d.update(seq_len=8))
    assert zorse_main(["show", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zorse: {path}: field 'seq_len' is 8, but stage_0.py") and err.count("\n") == 1
