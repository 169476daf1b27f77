"""``zorse box``: build, use and remove an emulated cluster on this machine (the CLI's part of ``Box``).

    zorse box up examples/clusters/small_hetero.yaml [--id ID] [--scale S] [--cores C] [--memory F]
    zorse box run ID --node t4-node [--rank 0] -- python -c 'import socket; print(socket.gethostname())'
    zorse box down ID
    zorse box gc          # boxes whose holder is gone, zbox- leftovers without a state file
"""

from __future__ import annotations

import argparse
import sys

from ..errors import BoxConfigError, BoxStateFileError
from ..pacing import PACE_HEADROOM
from .box import Box, _sigterm_as_exit, gc, remove_box
from .layout import LATENCY_MECHANISMS, SPEED_MECHANISMS, BoxOptions
from .state import read_state

__all__ = ["add_parser"]


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number > 0") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number > 0")
    return v


def add_parser(sub) -> None:
    """Add ``zorse box`` and its subcommands to the ``zorse`` subparsers ``sub``."""
    pb = sub.add_parser("box", help="an emulated heterogeneous cluster on this machine: namespaces, shaped links, "
                                    "CPU quotas (root)",
                        description="Emulate a cluster file on this Linux machine: a network namespace per node "
                                    "(hostname = node name), a bridge per region, NIC, link and WAN rates with htb, "
                                    "latency with netem or a delay line, a cgroup per rank, its GPU's speed paced (or a CPU quota); links scaled "
                                    "so communication-to-compute ratios are the cluster's. Needs root.")
    bsub = pb.add_subparsers(dest="box_cmd", required=True, metavar="{up,run,down,gc}")
    opt = BoxOptions()
    up = bsub.add_parser("up", help="build a box from a cluster file (stays until `zorse box down`)")
    up.add_argument("cluster", help="cluster YAML file")
    up.add_argument("--id", dest="box_id", default=None,
                    help="the box's name: letters, digits, '_' (default: the cluster's name)")
    up.add_argument("--scale", type=_positive, default=None, metavar="S",
                    help="bandwidth_box = bandwidth x S, delay_box = latency / S (default: the factor that keeps "
                         "the cluster's communication-to-compute ratio)")
    up.add_argument("--cores", type=_positive, default=None, metavar="C",
                    help="CPU cores the ranks' quotas may sum to (default: the CPUs this process may use)")
    up.add_argument("--precision", choices=("auto", "fp32", "bf16-mixed", "fp16-mixed"), default=opt.precision,
                    help="the real training's precision: the GPU types' relative speed is their 16-bit matmul "
                         "rate (auto, *-mixed) or their FP32 rate")
    up.add_argument("--cpu-profile", default=None, metavar="FILE",
                    help="a kernel profile of this CPU with one thread (`zorse bench kernels`) for the CPU's speed "
                         "(default: zorse_fx/profiles/cpu-x86_64-1thread.json)")
    up.add_argument("--memory", dest="memory_scale", type=_positive, default=None, metavar="F",
                    help="memory limit per rank: F x its GPU's memory + --memory-base-mib (default: no limit)")
    up.add_argument("--memory-base-mib", type=_positive, default=opt.memory_base_bytes / 2**20, metavar="MIB",
                    help="what a rank holds besides GPU memory, added to each limit (default %(default)g)")
    up.add_argument("--latency", choices=LATENCY_MECHANISMS, default=opt.latency,
                    help="how latency is made: netem, the delay line, none (auto: netem where the kernel has it)")
    up.add_argument("--speed", choices=SPEED_MECHANISMS, default=opt.speed,
                    help="how a rank gets its GPU type's speed: pace (default: each compute takes 1/q x its CPU "
                         "time, communication and host code at the CPU's speed) or quota (a CFS CPU quota of q "
                         "cores on the whole rank; short bursts escape it)")
    up.add_argument("--no-drift-probe", dest="drift_probe", action="store_false",
                    help="with --speed pace: pace on raw CPU time instead of in units of a reference probe fixed "
                         "at box up (which keeps the emulated GPUs' speed when this host's speed drifts)")
    up.add_argument("--no-tcp-tuning", dest="tcp_tuning", action="store_false",
                    help="keep the kernel's TCP defaults in the nodes' namespaces instead of tuning them for long "
                         "fat networks (buffers up to 2x the largest bandwidth-delay product, no slow start after "
                         "idle), to measure untuned hosts")
    up.set_defaults(fn=_up)
    run = bsub.add_parser("run", help="run a command on a node of a box (its namespace, hostname, a cgroup)")
    run.add_argument("box_id", metavar="ID")
    run.add_argument("--node", required=True, help="the node to run on")
    run.add_argument("--rank", type=int, default=None,
                     help="run in this local rank's cgroup (its CPU quota); default: the node's, without a limit")
    run.add_argument("argv", nargs="+", metavar="-- CMD", help="the command (after --)")
    run.set_defaults(fn=_run)
    down = bsub.add_parser("down", help="remove boxes: processes, namespaces, cgroups, files")
    down.add_argument("box_ids", nargs="+", metavar="ID")
    down.set_defaults(fn=_down)
    g = bsub.add_parser("gc", help="remove boxes whose holder process is gone and zbox- leftovers")
    g.set_defaults(fn=_gc)


def _up(args) -> int:
    options = BoxOptions(box_id=args.box_id, scale=args.scale, cores=args.cores, precision=args.precision,
                         cpu_profile=args.cpu_profile, memory_scale=args.memory_scale,
                         memory_base_bytes=round(args.memory_base_mib * 2**20), latency=args.latency,
                         speed=args.speed, drift_probe=args.drift_probe, tcp_tuning=args.tcp_tuning)
    with _sigterm_as_exit():  # Ctrl-C or SIGTERM while building: what was built is removed
        box = Box.create(args.cluster, options, hold=False)
    layout = box.layout
    print(layout.table(), end="")
    if box.state.pace_reference_s is not None:
        print(f"Paced in units of a reference probe of {box.state.pace_reference_s * 1e3:.3g} ms CPU "
              f"(ZORSE_PACE_REFERENCE: this host's probe now x {PACE_HEADROOM:g})")
    print(f"[zorse] box {layout.box_id!r} is up (state: /run/zorse_box/{layout.box_id}.json); run on a node with "
          f"`zorse box run {layout.box_id} --node {layout.nodes[0].name} [--rank 0] -- CMD`, remove it with "
          f"`zorse box down {layout.box_id}`", flush=True)
    return 0


def _run(args) -> int:
    Box.find(args.box_id).exec(args.node, args.argv, rank=args.rank)
    return 0  # (not reached: exec replaces this process)


def _down(args) -> int:
    from . import net
    from .box import _box_of, _cgroup_box_dirs

    for box_id in args.box_ids:
        try:
            state = read_state(box_id)
        except BoxStateFileError as exc:
            print(f"zorse: {exc}; removing box {box_id!r} by its names", file=sys.stderr)
            state = None
        except BoxConfigError:
            if not any(_box_of(n) == box_id for n in net.list_namespaces()) and box_id not in _cgroup_box_dirs():
                raise
            state = None  # no state file, but namespaces or cgroups of that name: removed by their names
        remove_box(box_id, state)
        print(f"[zorse] box {box_id!r} removed", flush=True)
    return 0


def _gc(args) -> int:
    removed, kept = gc()
    print(f"[zorse] removed {len(removed)} box(es){': ' + ', '.join(removed) if removed else ''}; kept "
          f"{len(kept)} (held by a running process, or detached: `zorse box down ID`)"
          f"{': ' + ', '.join(kept) if kept else ''}", flush=True)
    return 0
