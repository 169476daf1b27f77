"""``zorse_fx.ir``: the records between the phases are plain Python, and the
layers contract (``pyproject.toml``, ``[tool.importlinter]``) catches a
backward import, naming both modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zorse_fx.ir import SCHEDULES, Action, TensorSpec, make_schedule
from zorse_fx.ir.tensor import ITEMSIZE

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def test_importing_ir_loads_neither_torch_nor_ortools():
    code = ("import sys, zorse_fx.ir; "
            "print(sorted(m for m in ('torch', 'ortools', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_itemsize_table_matches_torch():
    for name, size in ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name
    spec = TensorSpec(name="h", shape_per_sample=(7, 3), dtype="bfloat16")
    assert spec.bytes_per_sample == 7 * 3 * 2
    with pytest.raises(ValueError, match="'h': dtype 'float4' is not one of"):
        _ = TensorSpec(name="h", shape_per_sample=(2,), dtype="float4").bytes_per_sample


@pytest.mark.parametrize("name,stages,mbs,v", [(n, 3, 5, 1) for n in SCHEDULES] + [("1f1b", 4, 4, 2)])
def test_action_prints_and_parses_back(name, stages, mbs, v):
    actions = [a for group in make_schedule(name, stages, mbs, v) for a in group]
    assert any(a.chunk for a in actions) == (v > 1)
    for a in actions:
        assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["X1", "F", "F-1", "B2.0", "F1.1.1", "", "f1"])
def test_action_parse_names_the_bad_text(text):
    with pytest.raises(ValueError, match=f"action {text!r}"):
        Action.parse(text)


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is installed by the test extra (make test)")
def test_layers_contract_kept_and_a_backward_import_named(tmp_path):
    ok = subprocess.run([str(LINT)], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "zorse_fx phases import downwards only KEPT" in ok.stdout
    # The same package with one backward import: the records reaching up into the solver.
    shutil.copytree(ROOT / "zorse_fx", tmp_path / "zorse_fx", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    victim = tmp_path / "zorse_fx" / "ir" / "decision.py"
    victim.write_text(victim.read_text() + "\nfrom ..solve import objective  # noqa: E402,F401\n")
    bad = subprocess.run([str(LINT)], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert bad.returncode != 0
    assert "zorse_fx phases import downwards only BROKEN" in bad.stdout
    assert "zorse_fx.ir.decision -> zorse_fx.solve" in bad.stdout, bad.stdout[-3000:]


def test_cli_demo_and_bench_use_only_public_names():
    """The CLI, the demo and the benchmarks reach zorse_fx through public names only
    (no ``_name``, no module whose path has a ``_`` part), so a move inside the
    package does not break them."""
    import ast

    files = [ROOT / "zorse_fx" / "cli.py", ROOT / "examples" / "demo.py", *sorted((ROOT / "bench").glob("*.py"))]
    private = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zorse_fx"):
                private += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") or any(p.startswith("_") for p in node.module.split("."))]
    assert not private, private
