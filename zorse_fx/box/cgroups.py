"""Per-rank CPU quotas and memory limits of a box as cgroups, v1 or v2, whichever the machine has.

A box's cgroups form one tree per hierarchy (v1: the ``cpu`` and ``memory`` hierarchies; v2: the
unified one)::

    zbox-<id>/_router              the delay line (no limit)
    zbox-<id>/<node>/agent         what runs on the node outside a rank (torchrun's agent, a shell)
    zbox-<id>/<node>/rank<j>       local rank j: its memory limit (and peak), over both leaves below
    zbox-<id>/<node>/rank<j>/host  the rank while it starts (imports, capture, loading): no CPU quota
    zbox-<id>/<node>/rank<j>/gpu   the rank from its first training step on: its GPU's speed as a CPU quota
                                   (``--speed quota``; a paced box's has none, [Note: paced compute])

Processes live in leaves only (v2's rule, kept on v1 too). Why a rank has two leaves: [Note: host
and GPU leaves]. Files read and written: v1
``cpu.cfs_period_us``, ``cpu.cfs_quota_us``, ``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``;
v2 ``cpu.max``, ``memory.max``, ``memory.peak``, ``cgroup.kill``.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BoxSetupError

__all__ = ["Cgroups", "ROUTER_LEAF", "AGENT_LEAF", "rank_dir", "rank_leaf", "kill_and_remove", "pids_under"]

ROUTER_LEAF = "_router"
AGENT_LEAF = "agent"

# [Note: host and GPU leaves]
# A rank's CPU quota stands for its GPU's speed ([Note: CPU quotas] in layout.py), but on a real
# cluster a rank's start -- importing torch, capturing and compiling the model, loading weights,
# rendezvous -- runs on the node's host CPU, which is no slower on a T4 node than on an H100 node.
# Under the quota from the start, a T4 rank (0.085 cores on small_hetero) would take 16 s to import
# torch, and every launch, restart and elastic re-plan on the box would measure the quota, not the
# plan. So a rank has two leaves under one directory: `host` (no quota), where `rank_enter` puts a
# torchrun worker, and `gpu` (the quota), which the worker enters just before its first training
# step and leaves for `host` after its last (train.py, `rank_enter.enter_rank_leaf`: the final
# checkpoint, destroy_process_group and the exit are host work too; a T4 rank's exit took 12 s more
# under its quota); the memory limit and peak are the directory's, over both (on
# v1, memory charged in `host` stays there and still counts against the directory's limit:
# memory.use_hierarchy, always 1 on kernels >= 5.x).


def rank_dir(local_rank: int) -> str:
    """Local rank ``local_rank``'s directory: its memory limit and peak."""
    return f"rank{local_rank}"


def rank_leaf(local_rank: int, phase: str = "gpu") -> str:
    """Local rank ``local_rank``'s leaf: ``host`` (starting, no quota) or ``gpu`` (training, its quota)."""
    if phase not in ("host", "gpu"):
        raise ValueError(f"rank_leaf phase {phase!r}: 'host' or 'gpu'")
    return f"rank{local_rank}/{phase}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cgroups:
    """Where this machine's CPU (and memory) controllers are mounted, and how to use them."""

    #: 1 (a ``cpu`` hierarchy) or 2 (the unified hierarchy with the ``cpu`` controller).
    version: int
    #: Mount point of the hierarchy holding the cpu controller.
    cpu_root: str
    #: Mount point of the hierarchy holding the memory controller, or None (no memory controller).
    memory_root: str | None

    @classmethod
    def detect(cls, mountinfo: str | None = None) -> Cgroups:
        """The cgroup hierarchies of this machine, from ``/proc/self/mountinfo``: v2 where the unified
        hierarchy offers the ``cpu`` controller, else v1's ``cpu`` (and ``memory``) hierarchies.
        ``BoxSetupError`` where neither offers a cpu controller."""
        text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
        v1: dict[str, str] = {}
        v2: list[str] = []
        for line in text.splitlines():
            pre, _, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            mount, fstype, options = fields[4], tail[0], tail[2].split(",")
            if fstype == "cgroup2":
                v2.append(mount)
            elif fstype == "cgroup":
                for controller in ("cpu", "memory"):
                    if controller in options:
                        v1.setdefault(controller, mount)
        for mount in v2:
            path = Path(mount) / "cgroup.controllers"
            controllers = _read(path).split() if path.exists() else []
            if "cpu" in controllers:
                return cls(version=2, cpu_root=mount, memory_root=mount if "memory" in controllers else None)
        if "cpu" in v1:
            return cls(version=1, cpu_root=v1["cpu"], memory_root=v1.get("memory"))
        raise BoxSetupError("no cgroup hierarchy with the cpu controller is mounted (neither cgroup v2's cpu.max "
                            "nor v1's cpu.cfs_quota_us): the box cannot give ranks CPU quotas here")

    def roots(self) -> tuple[str, ...]:
        """The hierarchies a box makes its tree in."""
        return tuple(dict.fromkeys(r for r in (self.cpu_root, self.memory_root) if r is not None))

    def box_dirs(self, box_id: str) -> tuple[str, ...]:
        """The box's top directory in each hierarchy."""
        return tuple(str(Path(r) / f"zbox-{box_id}") for r in self.roots())

    def leaf_dirs(self, box_id: str, node: str | None, leaf: str) -> tuple[str, ...]:
        """A leaf's directory in each hierarchy (``node`` None: a leaf of the box itself, ``_router``)."""
        parts = (leaf,) if node is None else (node, leaf)
        return tuple(str(Path(d, *parts)) for d in self.box_dirs(box_id))

    def create(self, box_id: str, leaves: list[tuple[str | None, str, float | None, int | None]],
               period_us: int) -> None:
        """Make the box's tree: ``leaves`` is ``(node or None, leaf, quota in cores or None, memory limit in
        bytes or None)`` per leaf or directory (``leaf`` may be a path, ``rank0/gpu``; its parents are made
        first, a directory listed before its children). ``BoxSetupError`` naming the file the kernel refused."""
        if self.version == 2:
            _enable(Path(self.cpu_root), self._controllers())
        for d in self.box_dirs(box_id):
            _mkdir(Path(d))
            if self.version == 2:
                _enable(Path(d), self._controllers())
        for node, leaf, quota, memory in leaves:
            parents = ([node] if node is not None else []) + leaf.split("/")[:-1]
            for d in self.box_dirs(box_id):
                for k in range(1, len(parents) + 1):  # the node's directory, a rank's directory
                    _mkdir(Path(d, *parents[:k]))
                    if self.version == 2:
                        _enable(Path(d, *parents[:k]), self._controllers())
            for d in self.leaf_dirs(box_id, node, leaf):
                _mkdir(Path(d))
            cpu = Path(self.leaf_dirs(box_id, node, leaf)[0])
            if quota is not None:
                quota_us = max(1000, round(quota * period_us))
                if self.version == 2:
                    _write(cpu / "cpu.max", f"{quota_us} {period_us}")
                else:
                    _write(cpu / "cpu.cfs_period_us", str(period_us))
                    _write(cpu / "cpu.cfs_quota_us", str(quota_us))
            if memory is not None:
                mem = self._memory_dir(box_id, node, leaf)
                if mem is None:
                    raise BoxSetupError("memory limits asked for (--memory), but no cgroup hierarchy has the memory "
                                        "controller")
                if self.version == 2:
                    _write(mem / "memory.max", str(memory))
                    if (mem / "memory.swap.max").exists():
                        _write(mem / "memory.swap.max", "0")  # the limit is the memory, not memory + swap
                else:
                    _write(mem / "memory.limit_in_bytes", str(memory))
                    if (mem / "memory.memsw.limit_in_bytes").exists():  # memory + swap: the same (no swap)
                        _write(mem / "memory.memsw.limit_in_bytes", str(memory))
                    if (mem / "memory.swappiness").exists():
                        _write(mem / "memory.swappiness", "0")

    def join(self, pid: int, box_id: str, node: str | None, leaf: str) -> None:
        """Move process ``pid`` (0: the caller) into a leaf, in every hierarchy."""
        for d in self.leaf_dirs(box_id, node, leaf):
            _write(Path(d) / "cgroup.procs", str(pid or os.getpid()))

    def cpu_quota(self, box_id: str, node: str, leaf: str) -> tuple[int | None, int]:
        """``(quota_us or None for no limit, period_us)`` of a leaf, read back from the kernel."""
        cpu = Path(self.leaf_dirs(box_id, node, leaf)[0])
        if self.version == 2:
            quota, period = _read(cpu / "cpu.max").split()
            return (None if quota == "max" else int(quota)), int(period)
        quota = int(_read(cpu / "cpu.cfs_quota_us"))
        return (None if quota < 0 else quota), int(_read(cpu / "cpu.cfs_period_us"))

    def memory_limit(self, box_id: str, node: str, leaf: str) -> int | None:
        """A leaf's memory limit in bytes, read back (None: no memory controller or no limit)."""
        mem = self._memory_dir(box_id, node, leaf)
        if mem is None:
            return None
        text = _read(mem / ("memory.max" if self.version == 2 else "memory.limit_in_bytes"))
        value = None if text == "max" else int(text)
        return None if value is None or value >= 1 << 62 else value  # v1 writes "no limit" as ~2**63

    def memory_peak(self, box_id: str, node: str, leaf: str) -> int | None:
        """The most memory the leaf's processes held at once, bytes (v1 ``memory.max_usage_in_bytes``, v2
        ``memory.peak``); None without a memory controller or on a kernel without ``memory.peak``."""
        mem = self._memory_dir(box_id, node, leaf)
        if mem is None:
            return None
        path = mem / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(_read(path)) if path.exists() else None

    def oom_kills(self, box_id: str, node: str, leaf: str) -> int | None:
        """How many processes of the leaf (a rank's directory and the leaves below it) the kernel killed for
        a memory limit: ``oom_kill`` of v2 ``memory.events`` (hierarchical: the directory's counts its
        descendants'), or the sum over the directory and its children of v1 ``memory.oom_control``'s
        (kernels >= 4.13; v1 counts a kill in the memcg of the killed process only). None without a memory
        controller or that counter."""
        mem = self._memory_dir(box_id, node, leaf)
        if mem is None:
            return None
        dirs = [mem] if self.version == 2 else [mem, *(d for d in mem.iterdir() if d.is_dir())]
        total = None
        for d in dirs:
            path = d / ("memory.events" if self.version == 2 else "memory.oom_control")
            if not path.exists():
                continue
            for line in _read(path).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    total = (total or 0) + int(value)
        return total

    def probe(self) -> None:
        """Make, limit and remove a cgroup; ``BoxSetupError`` naming what the kernel refused."""
        name = f"zbox-probe{os.getpid()}"
        d = Path(self.cpu_root) / name
        try:
            if self.version == 2:
                _enable(Path(self.cpu_root), ("cpu",))
            _mkdir(d)
            if self.version == 2:
                _write(d / "cpu.max", "10000 100000")
            else:
                _write(d / "cpu.cfs_quota_us", "10000")
        finally:
            if d.exists():
                d.rmdir()

    def _controllers(self) -> tuple[str, ...]:
        return ("cpu", "memory") if self.memory_root else ("cpu",)

    def _memory_dir(self, box_id: str, node: str | None, leaf: str) -> Path | None:
        if self.memory_root is None:
            return None
        parts = (leaf,) if node is None else (node, leaf)
        return Path(self.memory_root, f"zbox-{box_id}", *parts)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise BoxSetupError(f"cannot read {path}: {exc.strerror}") from None


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise BoxSetupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise BoxSetupError(f"cannot create cgroup {path}: {exc.strerror} (the box needs root, or write access "
                            f"to the cgroup hierarchy)") from None


def _enable(path: Path, controllers: tuple[str, ...]) -> None:
    """v2: make ``controllers`` available to ``path``'s children (``cgroup.subtree_control``)."""
    have = _read(path / "cgroup.subtree_control").split()
    missing = [c for c in controllers if c not in have]
    if missing:
        _write(path / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def pids_under(top: str | os.PathLike[str]) -> set[int]:
    """Every process in the cgroup ``top`` and below it (an absent ``top``: none)."""
    pids: set[int] = set()
    for d, _, files in os.walk(top):
        if "cgroup.procs" in files:
            try:
                pids.update(int(p) for p in Path(d, "cgroup.procs").read_text().split())
            except OSError:  # removed while walked
                continue
    return pids


def kill_and_remove(tops: tuple[str, ...] | list[str], *, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in the cgroups ``tops`` (and below), then remove them bottom-up.
    ``BoxSetupError`` naming a cgroup still busy after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        for top in tops:
            kill = Path(top, "cgroup.kill")
            if kill.exists():  # v2: the kernel kills every process below, forks included
                try:
                    kill.write_text("1")
                except OSError:
                    pass
        pids = set().union(*(pids_under(t) for t in tops)) if tops else set()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        busy = []
        for top in tops:
            for d, _, _ in os.walk(top, topdown=False):
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise BoxSetupError(f"cannot remove cgroup {d}: {exc.strerror}") from None
                    busy.append(d)
        if not busy:
            return
        if time.monotonic() > end:
            raise BoxSetupError(f"cgroups still busy after {timeout_s:g} s of SIGKILL: {', '.join(busy)} "
                                f"(processes: {sorted(pids)})")
        time.sleep(0.02)
