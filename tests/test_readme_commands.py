"""Every `zorse ...` command in README.md's shell code blocks runs as written.

Each command is parsed by the real CLI parser (`cli.build_parser`), so a README
line with a wrong option or an unknown subcommand fails here with the line
quoted. The cheap ones are also run, in a scratch directory holding the plan
they name: `zorse --version`, `--help`s, `zorse show`, `zorse prepare-data`
and `zorse bench comm` (2 Gloo ranks, the README's own sweep, ~15 s); the
training and planning commands (minutes each here) are parsed only."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zorse_fx.cli import build_parser
from zorse_fx.cli import main as zorse_main

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)


def readme_commands(text: str) -> list[str]:
    """The `zorse ...` commands of the shell code blocks, continuation lines joined, comments kept."""
    cmds = []
    for block in SHELL_BLOCK.findall(text):
        lines, cur = [], ""
        for line in block.splitlines():
            if cur:
                cur += " " + line.strip()
            else:
                cur = line.strip()
            if cur.endswith("\\"):
                cur = cur[:-1].rstrip()
                continue
            lines.append(cur)
            cur = ""
        cmds += [ln for ln in lines if ln.startswith("zorse ") or ln == "zorse"]
    return cmds


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def _argv(cmd: str) -> list[str]:
    words = shlex.split(cmd, comments=True)
    assert words[0] == "zorse", cmd
    return words[1:]


def test_readme_has_the_commands_this_test_is_about():
    firsts = {tuple(_argv(c)[:2]) for c in COMMANDS}
    assert {("--version",), ("bench", "comm"), ("bench", "kernels")} <= {f[:1] if f[0].startswith("-") else f
                                                                        for f in firsts}, COMMANDS
    assert any(_argv(c)[0] == "train" for c in COMMANDS) and any(_argv(c)[0] == "show" for c in COMMANDS)


def _id(cmd: str) -> str:
    return " ".join(_argv(cmd))[:70]


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_readme_command_parses(cmd):
    argv = _argv(cmd)
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code == 0 and ("--help" in argv or "-h" in argv or "--version" in argv):
            return  # --help / --version print and exit 0
        lines = err.getvalue().strip().splitlines()
        pytest.fail(f"README.md command does not parse: {cmd!r}\n  {lines[-1] if lines else f'exit {e.code}'}")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory with the plan README's commands name (runs/x/plan: a tiny GPT on small_hetero)."""
    d = tmp_path_factory.mktemp("readme")
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(ROOT / "examples/clusters/small_hetero.yaml"),
                       "--global-batch-size", "8", "--seq-len", "32", "--planner", "stage_dp",
                       "-o", str(d / "runs/x/plan")]) == 0
    return d


def _run(cmd: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run a README command in ``cwd`` (`zorse` = this checkout's CLI); stop its job on a timeout.
    The Hugging Face / ``datasets`` caches (`datasets.load_dataset` writes lock
    files there) are under ``cwd``, not the user's ~/.cache shared with other
    test processes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HOME=str(cwd / "hf-cache"),
               HF_DATASETS_CACHE=str(cwd / "hf-cache" / "datasets"))
    proc = subprocess.Popen([sys.executable, "-m", "zorse_fx.cli", *_argv(cmd)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the CLI stops its torchrun job (runtime/launch.py)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        pytest.fail(f"README.md command did not finish in {timeout_s} s: {cmd!r}\n{out[-2000:]}{err[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _data_inputs(d: Path) -> None:
    """The inputs README's `zorse prepare-data` examples name, made once in ``d``
    from real text (the Lee corpus) and the shipped SmolLM2 tokenizer:
    books/*.txt, news.jsonl (field "body"), saved_ds/ (a DatasetDict with a
    "train" split, save_to_disk) and my_tokenizer/ (save_pretrained)."""
    if (d / "my_tokenizer").exists():
        return
    import datasets

    from zorse_fx.data import read_corpus
    from zorse_fx.token_data import load_tokenizer

    docs = [ln for ln in read_corpus("lee").splitlines() if ln.strip()][:20]
    (d / "books").mkdir()
    for i, doc in enumerate(docs[:5]):
        (d / "books" / f"{i:02d}.txt").write_text(doc)
    (d / "news.jsonl").write_text("".join(json.dumps({"body": doc}) + "\n" for doc in docs[5:10]))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[10:]})}).save_to_disk(d / "saved_ds")
    load_tokenizer("smollm2-135m").hf.save_pretrained(d / "my_tokenizer")


def _cheap(cmd: str) -> bool:
    argv = _argv(cmd)
    return ("--help" in argv or "--version" in argv or argv[0] in ("show", "prepare-data")
            or argv[:2] == ["bench", "comm"])


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _cheap(c)], ids=_id)
def test_readme_command_runs(cmd, scratch):
    argv = _argv(cmd)
    if argv[0] == "show" or "--help" in argv or "--version" in argv:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                cwd = os.getcwd()
                os.chdir(scratch)
                try:
                    status = zorse_main(argv)
                finally:
                    os.chdir(cwd)
        except SystemExit as e:  # --help, --version
            status = e.code
        assert status == 0, f"README.md command failed: {cmd!r}\n{err.getvalue()[-2000:]}"
        text = out.getvalue()
        if "--help" in argv:
            assert "usage: zorse" in text and "--" in text.split("options:", 1)[-1], text
        if "--version" in argv:
            assert text.startswith("zorse_fx ")
        if argv[0] == "show":
            assert "stage |" in text
        return
    if argv[0] == "prepare-data":
        _data_inputs(scratch)
    res = _run(cmd, scratch)
    assert res.returncode == 0, f"README.md command failed: {cmd!r}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    if argv[0] == "prepare-data":
        out = scratch / argv[argv.index("-o") + 1]
        header = json.loads(out.with_suffix(".json").read_text())
        assert header["num_tokens"] > 0 and out.with_suffix(".bin").stat().st_size > 0, header
        return
    lines = res.stdout.splitlines()
    assert "links:" in lines, res.stdout
    link = lines[lines.index("links:") + 1]
    assert re.fullmatch(r"  intra_node: \{bandwidth_GBps: [0-9.e+-]+, latency_us: [0-9.e+-]+\}", link), link
    for word in argv:
        if word.startswith("profiles/"):
            assert (scratch / word).stat().st_size > 0, word


def test_a_wrong_readme_command_fails_with_the_line_quoted():
    """What the parse test reports for an unknown subcommand or option."""
    for cmd, needle in (("zorse prepare-datax --out d", "invalid choice: 'prepare-datax'"),
                        ("zorse train runs/x/plan --nope 1", "unrecognized arguments: --nope 1")):
        with pytest.raises(pytest.fail.Exception) as e:
            test_readme_command_parses(cmd)
        assert repr(cmd) in str(e.value) and needle in str(e.value)
