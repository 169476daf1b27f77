"""The docs' examples run as written (README.md and every page of docs/ but the generated reference):
every `zorse ...` command of their shell blocks, the `torchrun ... -m zorse_fx.train` line, and the
Python blocks of docs/guide/using.md. ("README" below: any of those pages.)

Every command is parsed by the real CLI parser (`cli.build_parser`), so a
README line with a wrong option or an unknown subcommand fails here with the
line quoted. Then each runs in a scratch directory laid out as README's
commands expect (`runs/x/plan` is the plan README's first `zorse plan`
makes; inputs of the prepare-data examples made from the Lee corpus;
`mymodel.py` from README's own block), except where a full run takes
minutes on this CPU:

- `zorse train`: run with `--dry-run` added: every check a run makes first
  (plan, weights, the token file or the corpus tokenized, `--resume`'s
  checkpoint, `--elastic`'s plan request), the options file written and the
  torchrun command printed, but no step (10-200 SmolLM2 steps take minutes);
- `torchrun ... -m zorse_fx.train ...` (every node of a multi-node run): its
  flags parsed by `zorse_fx.train`'s own parser;
- `zorse bench kernels`: its options checked (`kernels_main.check_args`)
  with the `graph` replay a GPU defaults to: README's command is for a GPU,
  and sweeping two Llama-2-7B layers takes minutes here;
- the second SmolLM2 `zorse plan` (`--use-all-gpus`): parsed only: it
  plans the same model on the same cluster as the first (another minute);
  the flag's effect is run by `tests/test_cli_checks.py::test_use_all_gpus_flag`.

The "Use" blocks run in order in one namespace, in a directory of their own
beside `examples/` (they read examples/clusters/ and write runs/x/plan)."""

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
from zorse_fx.plan import Plan

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


#: The pages whose examples run: README.md and docs/ but the reference pages docs/gen_reference.py generates.
DOC_PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.parent.name != "reference")]
DOCS_TEXT = "\n".join(p.read_text() for p in DOC_PAGES)
COMMANDS = list(dict.fromkeys(readme_commands(DOCS_TEXT)))  # (a command shown on two pages runs once)


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
        pytest.fail(f"docs command does not parse: {cmd!r}\n  {lines[-1] if lines else f'exit {e.code}'}")


README_PLAN = next(c for c in COMMANDS if _argv(c)[:1] == ["plan"] and "runs/x/plan" in _argv(c))
# parsed only, and why: see the module docstring
PARSED_ONLY = {c for c in COMMANDS if _argv(c)[:1] == ["plan"] and "--use-all-gpus" in _argv(c)}


def _in(cwd: Path, argv: list[str]) -> tuple[int, str, str]:
    """``zorse <argv>`` in this process, in ``cwd``: (status, stdout, stderr); --help / --version exit 0."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = zorse_main(argv)
            except SystemExit as e:
                status = e.code
    finally:
        os.chdir(here)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory for README's commands, holding the plan its first `zorse plan`
    makes (runs/x/plan: SmolLM2-135M on demo.yaml, as written), `examples/`
    (a link to this checkout's) and README's mymodel.py."""
    d = tmp_path_factory.mktemp("readme")
    (d / "examples").symlink_to(ROOT / "examples")
    (d / "mymodel.py").write_text(USE_BLOCKS["mymodel.py"])
    status, out, err = _in(d, _argv(README_PLAN))
    assert status == 0, f"docs command failed: {README_PLAN!r}\n{err[-3000:]}"
    assert "[zorse] wrote runs/x/plan/plan.json" in out
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
        pytest.fail(f"docs command did not finish in {timeout_s} s: {cmd!r}\n{out[-2000:]}{err[-2000:]}")
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


def _needs_scratch(cmd: str) -> bool:
    """Commands that read README's plan or write beside it (runs/...): one worker runs them all."""
    argv = _argv(cmd)
    return (argv[0] in ("plan", "show", "simulate") or (argv[0] == "train" and "--help" not in argv)
            or (argv[0] == "prepare-data" and argv[argv.index("-o") + 1].startswith("runs/")))


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if not _needs_scratch(c)], ids=_id)
def test_readme_command_runs(cmd, tmp_path_factory):
    argv = _argv(cmd)
    if "--help" in argv or "--version" in argv:
        status, text, err = _in(ROOT, argv)
        assert status == 0, f"docs command failed: {cmd!r}\n{err[-2000:]}"
        if "--help" in argv:
            assert "usage: zorse" in text and "--" in text.split("options:", 1)[-1], text
        if "--version" in argv:
            assert text.startswith("zorse_fx ")
        return
    if argv[:2] == ["bench", "kernels"]:  # for a GPU (see the module docstring): options checked, not run
        from zorse_fx.profiling import kernels_main

        parser = build_parser()
        args = parser.parse_args(argv)
        args.replay = args.replay or "graph"
        args = kernels_main.check_args(parser, args)
        assert args.batch_sizes == [1, 4] and args.seq_len == [512, 2048, 4096]
        return
    cwd = tmp_path_factory.getbasetemp() / "readme-data"
    cwd.mkdir(exist_ok=True)
    if argv[0] == "prepare-data":
        _data_inputs(cwd)
    res = _run(cmd, cwd)
    assert res.returncode == 0, f"docs command failed: {cmd!r}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    if argv[0] == "prepare-data":
        out = cwd / argv[argv.index("-o") + 1]
        header = json.loads(out.with_suffix(".json").read_text())
        assert header["num_tokens"] > 0 and out.with_suffix(".bin").stat().st_size > 0, header
        return
    lines = res.stdout.splitlines()
    assert "links:" in lines, res.stdout
    link = lines[lines.index("links:") + 1]
    assert re.fullmatch(r"  intra_node: \{bandwidth_GBps: [0-9.e+-]+, latency_us: [0-9.e+-]+\}", link), link
    for word in argv:
        if word.startswith("profiles/"):
            assert (cwd / word).stat().st_size > 0, word


def _prepared(cmd: str, scratch: Path) -> Path:
    """The token file README's `zorse prepare-data ... -o OUT` command ``cmd``
    writes, made once in ``scratch`` (a `zorse train --data OUT.bin` of README
    needs it, whichever of the two runs first); its .bin path."""
    argv = _argv(cmd)
    out = (scratch / argv[argv.index("-o") + 1]).with_suffix(".bin")
    if not out.exists():
        res = _run(cmd, scratch)
        assert res.returncode == 0, f"docs command failed: {cmd!r}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
    return out


def _maker(data: str) -> str:
    """README's `zorse prepare-data` command that writes ``data`` (OUT.bin)."""
    return next(c for c in COMMANDS if _argv(c)[0] == "prepare-data"
                and Path(_argv(c)[_argv(c).index("-o") + 1]).with_suffix(".bin") == Path(data))


@pytest.mark.xdist_group("readme_plan")
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _needs_scratch(c)], ids=_id)
def test_readme_command_runs_on_the_readme_plan(cmd, scratch):
    """The commands that read README's plan, as written (`zorse train` with
    --dry-run added; one plan command parsed only: see the module docstring)."""
    argv = _argv(cmd)
    if cmd in PARSED_ONLY:
        build_parser().parse_args(argv)
        return
    if cmd == README_PLAN:  # the scratch fixture ran it
        assert Plan.load(scratch / "runs/x/plan").model_name == "smollm2-135m"
        return
    if argv[0] == "prepare-data":
        header = json.loads(_prepared(cmd, scratch).with_suffix(".json").read_text())
        assert header["num_tokens"] > 0 and header["tokenizer"] == argv[argv.index("--tokenizer") + 1], header
        return
    if "--data" in argv:
        _prepared(_maker(argv[argv.index("--data") + 1]), scratch)
    if argv[0] == "train" and "--dry-run" not in argv:
        argv.append("--dry-run")
    status, out, err = _in(scratch, argv)
    assert status == 0, f"docs command failed: {cmd!r}\n{err[-3000:]}"
    if argv[0] == "show":
        assert "stage |" in out or "stage ┃" in out, out
    elif argv[0] == "simulate":
        assert (scratch / "runs/x/plan/simulate/trace.json").is_file() and "[zorse] simulated step" in out
    elif argv[0] == "plan":
        assert Plan.load(scratch / argv[argv.index("-o") + 1]).model_name == argv[argv.index("--model") + 1]
    else:
        assert out.splitlines()[-1].startswith("[zorse] --dry-run: plan, weights and data checked"), out
        if "--corpus" in argv:  # the plan's model's own tokenizer, said
            assert "tokenized with smollm2-135m into runs/x/data/tokens.bin" in out, out


def test_readme_torchrun_line_parses():
    """README's multi-node line: `torchrun ... -m zorse_fx.train <flags>` on each node."""
    from zorse_fx.train import parse_args

    lines = [ln.strip() for b in SHELL_BLOCK.findall(DOCS_TEXT) for ln in b.splitlines()
             if ln.strip().startswith("torchrun ")]
    assert lines, "the docs have no torchrun line"
    for line in lines:
        words = shlex.split(line, comments=True)
        flags = words[words.index("zorse_fx.train") + 1:]
        options = parse_args(flags)
        assert (options.data.plan, options.data.data) == ("runs/x/plan", "lee.bin"), line


# -- the "Use" section's Python blocks -------------------------------------------------------------

PYTHON_BLOCK = re.compile(r"^```python\s*\n(.*?)^```", re.M | re.S)


def use_blocks(text: str) -> dict[str, str]:
    """The Python blocks of docs/guide/using.md, by name: "mymodel.py" for
    the one that is that file (its first line says so), "1", "2", ... for the
    others, in order."""
    blocks, n = {}, 0
    for block in PYTHON_BLOCK.findall(text):
        words = block.splitlines()[0].split()
        if words[0] == "#" and words[1].endswith(".py:"):  # "# mymodel.py: ..."
            blocks[words[1].rstrip(":")] = block
        else:
            n += 1
            blocks[str(n)] = block
    return blocks


USE_BLOCKS = use_blocks((ROOT / "docs" / "guide" / "using.md").read_text())


def test_only_using_md_has_python_blocks_that_are_not_run():
    """Every Python block of the docs runs here: those of docs/guide/using.md (below); no other page has one."""
    assert [p.name for p in DOC_PAGES if PYTHON_BLOCK.search(p.read_text())] == ["using.md"]


def test_readme_use_blocks_run(tmp_path, monkeypatch, capsys):
    """Each block in order, in one namespace (a later block uses an earlier
    one's names), from a directory with examples/: every name is defined, the
    plan is exported and loads back, the simulated step and the decorated
    class's plan exist."""
    assert set(USE_BLOCKS) == {"1", "2", "3", "mymodel.py"}, sorted(USE_BLOCKS)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for name in ("1", "2", "3"):
        exec(compile(USE_BLOCKS[name], f"docs/guide/using.md block {name}", "exec"), namespace)
    assert Plan.load(tmp_path / "runs/x/plan") == namespace["plan"]
    assert (tmp_path / "runs/x/plan/weights.pt").is_file()
    assert namespace["sim"].step_time_s > 0
    assert type(namespace["model"]).__name__ == "CompiledModel" and namespace["model"].plan.num_stages >= 1
    assert "zorse_fx plan:" in capsys.readouterr().out
    mymodel = {}
    exec(compile(USE_BLOCKS["mymodel.py"], "mymodel.py", "exec"), mymodel)
    assert type(mymodel["build"]()).__name__ == "GPT"


# -- the --model names README lists are the registry's ----------------------------------------------

def test_readme_model_names_are_the_registrys():
    """README's `--model takes ...` sentence lists exactly the registry's
    names (then `module:function`), and every command's --model help is made
    from the registry (`registry.MODEL_HELP`): a name in one is in all."""
    from zorse_fx.models.registry import MODEL_HELP, MODEL_NAMES

    text = " ".join(DOCS_TEXT.split())
    m = re.search(r"`--model` takes (.*?) or `module:function`", text)
    assert m, "the docs have no `--model takes ...` sentence"
    assert tuple(re.findall(r"`([^`]+)` \(", m.group(1))) == MODEL_NAMES, m.group(1)
    assert MODEL_HELP.startswith(" | ".join(MODEL_NAMES) + " | module:function")
    for argv in (["plan", "--help"], ["simulate", "--help"], ["bench", "kernels", "--help"]):
        status, out, _ = _in(ROOT, argv)
        helptext = " ".join(out.split())
        assert status == 0 and all(name in helptext for name in MODEL_NAMES), (argv, helptext)
    for cmd in COMMANDS:
        argv = _argv(cmd)
        if "--model" in argv:
            name = argv[argv.index("--model") + 1]
            assert name in MODEL_NAMES or ":" in name or name in _published(), cmd


def _published() -> tuple[str, ...]:
    from zorse_fx.models import published

    return tuple(published.CONFIGS)


def test_a_wrong_readme_command_fails_with_the_line_quoted():
    """What the parse test reports for an unknown subcommand or option."""
    for cmd, needle in (("zorse prepare-datax --out d", "invalid choice: 'prepare-datax'"),
                        ("zorse train runs/x/plan --nope 1", "unrecognized arguments: --nope 1")):
        with pytest.raises(pytest.fail.Exception) as e:
            test_readme_command_parses(cmd)
        assert repr(cmd) in str(e.value) and needle in str(e.value)
