"""How a rank process ends ([Note: a rank ends without interpreter finalization] in zorse_fx/train.py).

``python -m zorse_fx.train`` ends by ``exit_rank``: its status kept, buffered
output flushed, and no interpreter finalization (no ``atexit`` handler runs),
where Gloo threads that outlive ``destroy_process_group`` could abort the
rank. A rank that dies in native code prints its threads' Python stacks
(``faulthandler``) before the signal ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_exit_rank_keeps_the_status_and_buffered_output_and_skips_finalization():
    """stdout to a pipe is block-buffered: the line reaches it only because
    exit_rank flushes; the atexit handler never runs (no finalization)."""
    got = _python("import atexit, sys\n"
                  "from zorse_fx.train import exit_rank\n"
                  "atexit.register(lambda: print('finalized'))\n"
                  "sys.stdout.write('written before the exit')\n"
                  "sys.stderr.write('and on stderr')\n"
                  "exit_rank(3)\n"
                  "print('after exit_rank')\n")
    assert got.returncode == 3
    assert got.stdout == "written before the exit"
    assert got.stderr == "and on stderr"


def test_exit_rank_with_a_closed_stdout_still_exits_with_its_status():
    got = _python("import sys\nfrom zorse_fx.train import exit_rank\nsys.stdout.close()\nexit_rank(5)\n")
    assert got.returncode == 5 and got.stderr == ""


def test_a_rank_aborted_in_native_code_prints_its_threads_python_stacks():
    """main enables faulthandler before anything else: an abort (here raised
    by the rank's own parse of its options, standing in for a C++
    std::terminate) prints each thread's Python stack on stderr; the process
    still dies by SIGABRT."""
    got = _python("import os, signal\n"
                  "import zorse_fx.train as t\n"
                  "def parse_args(argv):\n"
                  "    os.abort()\n"
                  "t.parse_args = parse_args\n"
                  "t.main(['unused'])\n")
    assert got.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in got.stderr
    assert 'in parse_args' in got.stderr and 'in main' in got.stderr
