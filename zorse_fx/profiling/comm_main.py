"""Entry point of ``zorse bench comm``, run under torchrun on every rank::

    torchrun --nproc-per-node=2 -m zorse_fx.profiling.comm_main --out profiles/comm_local.json \\
        [--sizes 1K:16M | --sizes 4K 64K 1M] [--iters N] [--warmup N] [--all-pairs] \\
        [--datacenter NAME] [--plot comm.png]

Backend: NCCL with tensors on ``cuda:LOCAL_RANK`` when CUDA is available, else
Gloo on CPU (one thread per rank). Rank 0 writes the profile JSON
(``zorse_fx.profiling.comm.CommProfile``), prints a summary table and the
cluster-YAML ``links:`` entries, and optionally a log-log plot of time vs bytes
with the fitted alpha-beta lines.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zorse_fx.profiling.comm import CommProfile, measure
from zorse_fx.runtime.launch import rank_device

__all__ = ["parse_sizes", "default_sizes", "build_parser", "parse_args", "check_args", "sweep_argv", "main"]

_UNITS = {"": 1, "B": 1, "K": 1024, "KIB": 1024, "M": 1024**2, "MIB": 1024**2, "G": 1024**3, "GIB": 1024**3}


def _size(token: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", token)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--sizes: {token!r} is not a size; use bytes or a K/M/G (KiB/MiB/GiB) suffix, e.g. 64K")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(tokens: list[str]) -> list[int]:
    """Sizes in bytes from ``["4K", "1M"]`` or ranges ``["1K:16M"]`` (powers of 2 from..to), sorted, unique.

    Each must be a multiple of 4 bytes (float32 buffers); at least 2 distinct sizes (for the fit).
    """
    sizes: set[int] = set()
    for tok in (t for part in tokens for t in part.split(",") if t.strip()):
        if ":" in tok:
            lo, hi = (_size(t) for t in tok.split(":", 1))
            s = lo
            while s <= hi:
                sizes.add(s)
                s *= 2
        else:
            sizes.add(_size(tok))
    bad = sorted(s for s in sizes if s < 4 or s % 4)
    if bad:
        raise ValueError(f"--sizes: {bad} bytes are not multiples of 4 (float32 buffers); e.g. 1K:16M")
    if len(sizes) < 2:
        raise ValueError(f"--sizes: need at least 2 distinct sizes to fit latency and bandwidth, got {sorted(sizes)}")
    return sorted(sizes)


def default_sizes(cuda: bool) -> list[int]:
    """1 KiB..16 MiB (powers of 2) on GPU; 1 KiB..4 MiB on CPU (keeps 2 Gloo ranks well under 20 s)."""
    return parse_sizes(["1K:16M" if cuda else "1K:4M"])


DESCRIPTION = ("Measure point-to-point and all-reduce times between the ranks torchrun started; fit latency + "
               "bytes / bandwidth per link class, and print the cluster-file `links:` entries.")


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of ``zorse bench comm`` (``add_help=False``: for the CLI's ``parents=``)."""
    p = argparse.ArgumentParser(prog="zorse bench comm", description=DESCRIPTION, add_help=add_help)
    p.add_argument("--out", required=True, help="profile JSON to write (rank 0), e.g. profiles/comm_mycluster.json")
    p.add_argument("--sizes", nargs="+", default=None,
                   help="message sizes: bytes with K/M/G suffix, or FROM:TO powers of 2 (default 1K:16M, CPU 1K:4M)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size before the timed ones")
    p.add_argument("--all-pairs", action="store_true",
                   help="ping-pong every rank pair (default: one representative pair per link class)")
    p.add_argument("--datacenter", default=os.environ.get("ZORSE_DATACENTER", ""),
                   help="this launch's datacenter name; ranks with different names are cross_datacenter")
    p.add_argument("--plot", default=None, help="also write a log-log PNG of time vs bytes with the fits")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Validate ``args`` (``p.error`` on a bad value) and turn ``--sizes`` into bytes."""
    try:
        args.sizes = parse_sizes(args.sizes) if args.sizes else None
    except ValueError as e:
        p.error(str(e))
    if args.iters is not None and args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be >= 1 and --warmup >= 0 (got {args.iters}, {args.warmup})")
    return args


def sweep_argv(args: argparse.Namespace) -> list[str]:
    """The options besides ``--out`` that make ``parse_args`` return ``args`` (checked: sizes in
    bytes); how ``zorse bench comm`` hands its options to the ranks."""
    argv = ["--warmup", str(args.warmup), "--backend", args.backend]
    if args.sizes:
        argv += ["--sizes", *map(str, args.sizes)]
    if args.iters is not None:
        argv += ["--iters", str(args.iters)]
    if args.all_pairs:
        argv.append("--all-pairs")
    if args.datacenter:
        argv += ["--datacenter", args.datacenter]
    if args.plot:
        argv += ["--plot", str(args.plot)]
    return argv


def print_summary(profile: CommProfile, out: Path) -> None:
    """Rich table: one row per (link class, op) fit, then the YAML to paste into a cluster file."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"zorse bench comm: {profile.world_size} ranks, {profile.backend}, {profile.device}")
    for col in ("link class", "op", "alpha (µs)", "bandwidth (GB/s)", "bus bw (GB/s)", "R²", "samples"):
        t.add_column(col, justify="left" if col in ("link class", "op") else "right")
    for f in profile.fits:
        t.add_row(f.link_class, f.op, f"{f.alpha_s * 1e6:.1f}", f"{f.bandwidth_bytes_per_s / 1e9:.3f}",
                  f"{f.bus_bandwidth_bytes_per_s / 1e9:.3f}", f"{f.r2:.4f}", str(len(f.samples)))
    console = Console(width=None if sys.stdout.isatty() else 110)
    console.print(t)
    classes = [f.link_class for f in profile.fits if f.op == "p2p"]
    if classes:
        console.print("cluster YAML (measured point-to-point):\nlinks:", markup=False)
        for c in classes:
            y = profile.link_yaml(c)
            console.print(f"  {c}: {{bandwidth_GBps: {y['bandwidth_GBps']:g}, latency_us: {y['latency_us']:g}}}",
                          markup=False)
    console.print(f"wrote {out}", markup=False)


def plot(profile: CommProfile, path: str | Path) -> Path:
    """Log-log PNG: measured medians (points) and fitted ``alpha + bytes / bandwidth`` (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in profile.fits:
        b = np.array([s for s, _ in f.samples], dtype=float)
        pts = ax.loglog(b, [t * 1e6 for _, t in f.samples], "o", ms=4, label=f"{f.link_class} {f.op}")
        xs = np.geomspace(b.min(), b.max(), 100)
        ax.loglog(xs, (f.alpha_s + xs / f.bandwidth_bytes_per_s) * 1e6, "-", color=pts[0].get_color(),
                  label=f"  fit: {f.alpha_s * 1e6:.1f} µs + bytes / {f.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time (µs)")
    ax.set_title(f"{profile.backend}, {profile.world_size} ranks, {profile.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    device = rank_device(backend)
    sizes = args.sizes or default_sizes(device.type == "cuda")
    iters = args.iters or 20
    dist.init_process_group(backend, timeout=timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)
    try:
        if dist.get_world_size() < 2:
            raise SystemExit("zorse bench comm: needs at least 2 ranks (torchrun --nproc-per-node 2 or more)")
        profile = measure(sizes, iters=iters, warmup=args.warmup, datacenter=args.datacenter,
                          all_pairs=args.all_pairs, device=device)
        if profile is not None:
            out = profile.save(args.out)
            print_summary(profile, out)
            if args.plot:
                print(f"wrote {plot(profile, args.plot)}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
