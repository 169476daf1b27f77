"""``python -m zorse_fx.box.rank_enter CMD...``: a torchrun worker on a box node enters its local
rank's ``host`` leaf (under its memory limit, no CPU quota yet), sets its ``ZORSE_PACE`` where the box
paces its ranks ([Note: paced compute] in zorse_fx/pacing.py), then becomes ``CMD``; ``zorse_fx.train``
moves it into the rank's ``gpu`` leaf (its CPU quota on a box with ``--speed quota``) at its first
training step (``enter_rank_leaf``; [Note: host and GPU leaves] in cgroups.py).

torchrun starts every worker in the cgroup it runs in itself (the node's ``agent`` leaf when started
by ``Box.spawn`` or ``zorse box run``); give it this module as the script and the real one after it::

    zorse box run <id> --node t4-node -- torchrun --nnodes 2 ... -m zorse_fx.box.rank_enter -m zorse_fx.train ...

``rank_enter --gpu CMD`` runs the whole command in the ``gpu`` leaf, under the quota from its start:
for benchmarks of what a rank's GPU does (``zorse_fx.profiling.comm_main``: on the box, communication's
CPU work is the rank's). The box (``ZORSE_BOX``), the node (``ZORSE_BOX_NODE``, both set by the box)
and ``LOCAL_RANK`` (set by torchrun) say which cgroup. ``CMD`` starting with ``-m``, ``-c`` or a ``.py`` file runs under this
Python; otherwise it is a program. An error is one line ``zorse: ...`` and exit status 1.
"""

from __future__ import annotations

import os
import sys

from ..errors import ZorseError
from ..pacing import ENV_PACE, ENV_PACE_REFERENCE
from .box import ENV_BOX, ENV_NODE
from .cgroups import rank_leaf
from .state import read_state

__all__ = ["main", "enter_rank_leaf"]


def _join(phase: str):
    """Join this rank's ``phase`` leaf; returns the box's state."""
    box_id, node, local = os.environ[ENV_BOX], os.environ[ENV_NODE], int(os.environ["LOCAL_RANK"])
    state = read_state(box_id)
    slot = state.layout.rank(node, local)
    state.cgroups.join(0, box_id, node, rank_leaf(slot.local_rank, phase))
    return state


def enter_rank_leaf(phase: str) -> bool:
    """Move this process into its rank's ``gpu`` leaf (its GPU's speed as a CPU quota) or back into its
    ``host`` leaf, where it runs as a torchrun worker on a box node (``ZORSE_BOX``, ``ZORSE_BOX_NODE`` and
    ``LOCAL_RANK`` set); whether it did. ``zorse_fx.train`` enters ``gpu`` before its first training step and
    ``host`` after its last ([Note: host and GPU leaves] in cgroups.py). ``ZorseError`` where the box's state
    or cgroups say otherwise (a box removed under the job)."""
    if not (os.environ.get(ENV_BOX) and os.environ.get(ENV_NODE) and os.environ.get("LOCAL_RANK", "").isdigit()):
        return False
    _join(phase)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    box_id, node, local = os.environ.get(ENV_BOX), os.environ.get(ENV_NODE), os.environ.get("LOCAL_RANK")
    if not argv:
        print("zorse: rank_enter: give the command to run after it (e.g. -m zorse_fx.train ...)", file=sys.stderr)
        return 1
    if not (box_id and node and local is not None and local.isdigit()):
        print(f"zorse: rank_enter: {ENV_BOX}={box_id!r}, {ENV_NODE}={node!r}, LOCAL_RANK={local!r}: start it with "
              f"torchrun inside a box (`zorse box run <id> --node NAME -- torchrun ...`)", file=sys.stderr)
        return 1
    phase = "host"
    if argv[0] == "--gpu":  # the whole command under the rank's quota: a benchmark (`zorse bench comm`, kernels)
        phase, argv = "gpu", argv[1:]
        if not argv:
            print("zorse: rank_enter: give the command to run after --gpu", file=sys.stderr)
            return 1
    try:
        pace = _join(phase).pace_environment(node, int(local))
    except ZorseError as exc:
        print(f"zorse: rank_enter: {exc}", file=sys.stderr)
        return 1
    os.environ.pop(ENV_PACE, None)
    os.environ.pop(ENV_PACE_REFERENCE, None)
    os.environ.update(pace)  # a paced box: the rank's computes at its GPU type's speed ([Note: paced compute])
    cmd = [sys.executable, *argv] if argv[0] in ("-m", "-c") or argv[0].endswith(".py") else argv
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
