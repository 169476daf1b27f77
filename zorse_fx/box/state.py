"""A box's state file, ``/run/zorse_box/<id>.json``: what was built, by whom, and how to remove it.

Written before the box makes anything (so every name it will create is on file when the first one
exists, and ``zorse box down``/``gc`` find a half-built box) and again once the delay line runs. Read
through ``file_schema`` like zorse_fx's other JSON files: a damaged or foreign file is refused with
its field and value, never half-trusted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from ..errors import BoxConfigError, BoxStateFileError
from ..pacing import ENV_PACE, ENV_PACE_REFERENCE
from ..file_schema import FileFormat, from_doc, struct_of, to_builtins
from .cgroups import Cgroups
from .layout import BOX_ID, BoxLayout, NodeLayout, PairLink, RankSlot, ScaleDerivation, SharedDirection

__all__ = ["BoxState", "STATE_DIR", "STATE_FILE", "state_path", "box_file", "write_state", "read_state",
           "state_ids", "holder_alive", "process_start_ticks"]

FORMAT = "zorse_fx.box"
VERSION = 1
#: Where every box's state file and helper files live (``<id>.json``, ``<id>.hosts``, ``<id>.delay*``).
STATE_DIR = Path("/run/zorse_box")


@dataclass(frozen=True, slots=True, kw_only=True)
class BoxState:
    """One box (fields in the file's order, after ``format`` and ``version``)."""

    box_id: str
    #: When ``zorse box up`` started, ISO 8601.
    created_at: str
    #: The process the box lives as long as (``Box.up``'s); None: detached (``zorse box up``), removed by
    #: ``zorse box down`` only.
    holder_pid: int | None
    #: The holder's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22): a reused pid is not it.
    holder_start: int | None
    cgroups: Cgroups
    #: The box's cgroup directories (one per hierarchy), removed whole.
    cgroup_dirs: tuple[str, ...]
    #: The box's network namespaces: the router's, then the nodes'.
    netns: tuple[str, ...]
    #: The delay line's process (in the router namespace), or None.
    delay_line_pid: int | None
    layout: BoxLayout
    #: A paced box's ``ZORSE_PACE_REFERENCE``: the reference probe's CPU seconds on its nominal host, measured
    #: when it came up ([Note: drift-compensated pacing] in zorse_fx/pacing.py); None: quotas, or raw CPU time.
    pace_reference_s: float | None = None

    def pace_environment(self, node: str, local_rank: int) -> dict[str, str]:
        """``ZORSE_PACE`` and ``ZORSE_PACE_REFERENCE`` of a rank of a paced box (empty: a quota box)."""
        pace = self.layout.pace_factor(node, local_rank)
        if pace is None:
            return {}
        out = {ENV_PACE: repr(pace)}
        if self.pace_reference_s is not None:
            out[ENV_PACE_REFERENCE] = repr(self.pace_reference_s)
        return out


_DOCS: dict[type, type] = {}
for _cls in (RankSlot, NodeLayout, PairLink, SharedDirection, ScaleDerivation, Cgroups, BoxLayout):  # inner first
    _DOCS[_cls] = struct_of(_cls, f"{_cls.__name__}Doc", docs=_DOCS)
BoxStateDoc = struct_of(BoxState, "BoxStateDoc", docs=_DOCS, extra={
    "": [("format", Literal["zorse_fx.box"], msgspec.NODEFAULT), ("version", Literal[1], msgspec.NODEFAULT)],
})
#: The box state file as a ``file_schema.FileFormat``.
STATE_FILE = FileFormat(name=FORMAT, what="box state", doc=BoxStateDoc, versions=(VERSION,),
                        remake="remove the box by its names with `zorse box down <id>`", error=BoxStateFileError)


def state_path(box_id: str) -> Path:
    return STATE_DIR / f"{box_id}.json"


def box_file(box_id: str, suffix: str) -> Path:
    """One of the box's helper files: ``hosts``, ``delay.json`` (the delay line's configuration),
    ``delay-stats.json``, ``delay.log``."""
    return STATE_DIR / f"{box_id}.{suffix}"


def write_state(state: BoxState, *, new: bool = False) -> Path:
    """Write ``state`` whole (a temporary file renamed into place); ``new``: refuse when the box's state
    file exists already (``BoxConfigError``: two boxes with one id)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = state_path(state.box_id)
    text = json.dumps(to_builtins(state, BoxStateDoc, lambda r: {"format": FORMAT, "version": VERSION}
                                  if isinstance(r, BoxState) else {}), indent=1) + "\n"
    if new:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise BoxConfigError(f"a box {state.box_id!r} exists ({path}); remove it with `zorse box down "
                                 f"{state.box_id}`, or give another id (--id)") from None
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_state(box_id: str) -> BoxState:
    """The state of box ``box_id``: ``BoxConfigError`` naming the boxes there are when it has no state
    file, ``BoxStateFileError`` when the file is damaged."""
    path = state_path(box_id)
    if not path.is_file():
        have = ", ".join(state_ids()) or "none"
        raise BoxConfigError(f"no box {box_id!r} (no {path}); boxes on this machine: {have}")
    _, doc = STATE_FILE.read(path)
    return from_doc(doc, BoxState)


def state_ids() -> list[str]:
    """The ids of every box with a state file, sorted."""
    if not STATE_DIR.is_dir():
        return []
    names = (p.name[:-len(".json")] for p in STATE_DIR.glob("*.json"))
    return sorted(n for n in names if BOX_ID.fullmatch(n))  # (not a helper file: <id>.delay.json)


def process_start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks after boot, or None where there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3, starttime field 22
    return None if fields[0] == "Z" else int(fields[19])


def holder_alive(state: BoxState) -> bool:
    """Whether the box's holder still runs (a detached box, without one, counts as held)."""
    if state.holder_pid is None:
        return True
    return process_start_ticks(state.holder_pid) == state.holder_start
