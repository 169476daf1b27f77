"""Start the ranks of a plan with torchrun on this machine (``zorse train``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["torchrun_command", "launch", "rank_device"]


def rank_device(backend: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (selected) for NCCL, else the CPU."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def torchrun_command(plan_dir: str | Path, nprocs: int, train_args: list[str]) -> list[str]:
    """The torchrun command line that runs ``plan_dir`` on ``nprocs`` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
        "-m", "zorse_fx.train", str(plan_dir), *train_args,
    ]


def launch(plan_dir: str | Path, nprocs: int, train_args: list[str], *, timeout_s: float | None = None,
           capture: bool = False) -> subprocess.CompletedProcess:
    """Run the plan on ``nprocs`` local processes; raises CalledProcessError on failure."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # each rank uses one thread
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = torchrun_command(plan_dir, nprocs, train_args)
    return subprocess.run(cmd, env=env, check=True, timeout=timeout_s, text=True,
                          capture_output=capture)
