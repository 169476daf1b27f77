"""Start ``zorse bench comm`` on this machine: torchrun with ``nproc`` local ranks.

For several machines, run the same module under torchrun on each one
(``--nnodes``, ``--rdzv-endpoint``) with ``--datacenter NAME`` where relevant::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m zorse_fx.profiling.comm_main --out profiles/comm_mycluster.json
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zorse_fx.errors import RuntimeExecutionError, ZorseError

__all__ = ["comm_bench_command", "run_comm_bench", "BenchOptionsError"]


class BenchOptionsError(ZorseError, ValueError):
    """A ``zorse bench`` option that does not fit this machine."""


def comm_bench_command(nproc: int, out: str | Path, extra_args: list[str] = ()) -> list[str]:
    """The torchrun command line that measures ``nproc`` local ranks and writes ``out``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "zorse_fx.profiling.comm_main", "--out", str(out), *extra_args,
    ]


def run_comm_bench(nproc: int, out: str | Path, extra_args: list[str] = (), *, timeout_s: float | None = 600,
                   capture: bool = True) -> subprocess.CompletedProcess:
    """Run the benchmark on ``nproc`` local ranks (>= 2) and return the finished process.

    A failed rank raises ``RuntimeExecutionError`` (with the output's last lines
    when ``capture`` is on); SIGINT/SIGTERM stop every rank and raise
    ``runtime.launch.JobInterrupted``.

    ``OMP_NUM_THREADS=1`` (each rank one thread). With ``capture`` (default) the
    output is in the result's ``stdout``/``stderr`` (text); else it goes to the terminal.
    """
    if nproc < 2:
        raise ValueError(f"zorse bench comm needs at least 2 ranks to measure links, got nproc={nproc}")
    from zorse_fx.runtime.launch import JobFailedError, supervise

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = comm_bench_command(nproc, out, list(extra_args))
    try:  # supervised: a signal or a timeout stops torchrun and every rank (runtime/launch.py)
        return supervise(cmd, env, timeout_s=timeout_s, capture=capture)
    except JobFailedError as e:
        lines = ((e.stdout or "") + (e.stderr or "")).strip().splitlines()
        # The ranks' own exceptions ("[rank0]: ValueError: ...") come before torchrun's summary.
        causes = [ln for ln in lines if ln.startswith("[rank") and ("Error" in ln or "Exception" in ln)]
        tail = "\n".join(causes[:6] + lines[-15:])
        where = f"\n{tail}" if capture else " (the ranks' errors are above)"
        raise RuntimeExecutionError(f"zorse bench comm failed (exit {e.returncode}): {' '.join(cmd)}{where}") from e
