"""The exception policy of zorse_fx.

- ``ValueError`` subclasses: something the *user* got wrong (a cluster file, a
  plan file, a model zorse_fx cannot capture). Messages name the file, the
  field, the value and what would fix it.
- ``RuntimeError`` subclasses: the planner or the runtime could not do its job
  with valid input (no feasible plan, a rank failed). Messages name the binding
  constraint with numbers.
- ``assert`` is used only for internal invariants.
"""

from __future__ import annotations

__all__ = [
    "ZorseError",
    "ClusterConfigError",
    "FileFormatError",
    "PlanFileError",
    "TimingsFileError",
    "PlanOptionsError",
    "ModelCaptureError",
    "InfeasiblePlanError",
    "RuntimeExecutionError",
    "CheckpointError",
    "CheckpointDamagedError",
    "RunDirectoryError",
    "PlanDirectoryError",
    "WeightsFileError",
    "DataError",
    "ProfileFileError",
    "CheckpointManifestError",
    "TokenHeaderError",
    "TrainOptionsFileError",
    "BoxConfigError",
    "BoxSetupError",
    "BoxStateFileError",
    "short_repr",
]


class ZorseError(Exception):
    """Base class of every error zorse_fx raises on purpose."""


class ClusterConfigError(ZorseError, ValueError):
    """A cluster description (YAML file or dict) is invalid."""


class FileFormatError(ZorseError, ValueError):
    """A JSON file zorse_fx reads (plan.json, a kernel or communication
    profile, a checkpoint manifest, a token-file header) is missing,
    malformed or of an unsupported version. Raised by ``file_schema``; the
    message names the file, the field, the value and the fix, and so do the
    attributes ``path``, ``field`` and ``value`` (None where the error is not
    about one field). Each format raises its own subclass."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
                 value: object = None) -> None:
        super().__init__(message)
        self.path, self.field, self.value = path, field, value


class PlanFileError(FileFormatError):
    """A plan file (plan.json) is malformed or of an unsupported version."""


class TimingsFileError(FileFormatError):
    """A run's timings file (``<out>/timings.jsonl``) or a calibration file is
    missing, malformed or of an unsupported version."""


class PlanOptionsError(ZorseError, ValueError):
    """A planner option (``PlanOptions``, a ``zorse.compile`` keyword, a
    ``zorse plan`` flag) is invalid or does not fit the cluster (bf16-mixed
    asked for on a GPU without bfloat16)."""


class ModelCaptureError(ZorseError, ValueError):
    """The model cannot be captured or cut into pipeline stages."""


class InfeasiblePlanError(ZorseError, RuntimeError):
    """No plan satisfies the constraints (memory, batch divisibility, ...).

    The message names the binding constraint with numbers, e.g.
    ``stage 0 needs 21.3 GiB on T4 (16.0 GiB)``.
    """


class RuntimeExecutionError(ZorseError, RuntimeError):
    """A rank could not execute its part of a plan."""


class CheckpointError(ZorseError, ValueError):
    """A training checkpoint is incomplete, malformed, or of another model /
    global batch than the plan it is loaded into."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files are not those its manifest recorded when it
    was written: a file missing, of another size (truncated) or with another
    sha256 (bit rot, a partial overwrite), or an unreadable manifest. The
    message names the checkpoint, the file and what is wrong; ``path`` is the
    checkpoint directory, ``file`` the damaged file's name (None: the
    manifest itself)."""

    def __init__(self, message: str, *, path: str, file: str | None = None) -> None:
        super().__init__(message)
        self.path, self.file = path, file


class RunDirectoryError(ZorseError, ValueError):
    """A run directory (``--out``) that would mix two runs: a fresh run into a
    directory holding another run's checkpoints or ``metrics.jsonl``, or a
    ``--resume`` that finds nothing intact to resume. The message names the
    directory and the flag to pass (``--overwrite`` or ``--resume``)."""


class PlanDirectoryError(ZorseError, ValueError):
    """A directory a plan is to be written to (``zorse plan -o``,
    ``Plan.export``) that is not a plan directory: a file, or a directory
    holding files a plan does not write. The message names the directory and
    those files, and says to choose another."""


class WeightsFileError(ZorseError, ValueError):
    """A weights file (``weights.pt``, a dict canonical name -> tensor) does not
    fit the plan: a tensor the stage needs is missing, or has another shape or
    dtype than the stage's module expects."""


class _Full(Exception):
    """``short_repr``'s budget is spent."""


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, for error messages.

    Never builds the whole repr: containers (dict, list, tuple, set) are walked
    element by element and the walk stops once ``limit`` characters are
    written, so a huge or deeply shared value (a YAML alias bomb expands to
    billions of elements through a few shared lists) costs O(limit) time. A
    container met again inside itself reads ``[...]`` as in ``repr``; strings
    and other scalars are cut before their ``repr`` is taken. The cut is
    marked with a trailing ``...``.
    """
    out: list[str] = []
    room = [limit + 1]  # one more than fits: tells a cut from an exact fit

    def emit(text: str) -> None:
        out.append(text[: room[0]])
        room[0] -= len(text)
        if room[0] <= 0:
            raise _Full

    def walk(v: object, stack: set[int]) -> None:
        if isinstance(v, (dict, list, tuple, set, frozenset)):
            if id(v) in stack:
                return emit({dict: "{...}", list: "[...]", tuple: "(...)"}.get(type(v), "{...}"))
            stack.add(id(v))
            if isinstance(v, dict):
                emit("{")
                for i, (k, x) in enumerate(v.items()):
                    emit(", " if i else "")
                    walk(k, stack)
                    emit(": ")
                    walk(x, stack)
                emit("}")
            else:
                kind = type(v)
                opening, closing = {list: ("[", "]"), tuple: ("(", ")")}.get(kind, ("{", "}"))
                if not v and kind in (set, frozenset):
                    opening, closing = f"{kind.__name__}(", ")"
                emit(opening)
                for i, x in enumerate(v):
                    emit(", " if i else "")
                    walk(x, stack)
                emit("," + closing if kind is tuple and len(v) == 1 else closing)
            stack.discard(id(v))
        elif isinstance(v, (str, bytes)):
            emit(repr(v[: room[0]]) if len(v) > room[0] else repr(v))
        elif isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 4 * limit:
            emit(f"<int of {v.bit_length()} bits>")
        else:
            emit(repr(v))

    try:
        walk(value, set())
    except _Full:
        pass
    text = "".join(out)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


class DataError(ZorseError, ValueError):
    """A token file, its header, a corpus or a tokenizer is unusable (wrong
    dtype or shape, ids outside the vocabulary, a header that does not match
    its file, a corpus smaller than one global batch). The message names the
    file, the field, the value and the fix."""


class ProfileFileError(FileFormatError):
    """A kernel profile (``zorse bench kernels`` output, ``zorse_fx/profiles/*.json``)
    is missing, malformed or of an unsupported version. Raised by
    ``cost.profile.KernelProfile.load`` / ``from_dict``; the message names the
    file, the field, the value and the fix (re-run ``zorse bench kernels``)."""


class CheckpointManifestError(CheckpointError, FileFormatError):
    """A checkpoint's manifest (``zorse_checkpoint.json``) is missing,
    malformed or of an unsupported version. Raised by
    ``runtime.checkpoint.read_manifest``; a ``CheckpointError`` too, so callers
    catching that keep working."""


class TokenHeaderError(DataError, FileFormatError):
    """A token file's header (``<out>.json`` beside ``<out>.bin``) is
    malformed, of an unsupported version, or does not fit its dtype. Raised by
    ``token_data.TokenData.open``; a ``DataError`` too. The fix: rewrite the
    token file with ``zorse prepare-data``."""


class TrainOptionsFileError(FileFormatError):
    """A training-options file (``<out>/train_options.json``, written by
    ``zorse train``) that is missing, not JSON, of another format or version,
    or holds an unknown field, a value of the wrong type or a value the loop
    cannot use. Raised by ``train_options.read_options_file``; the message
    names the file, the field and the value."""


class BoxConfigError(ZorseError, ValueError):
    """A cluster ``zorse box`` cannot emulate on this machine as asked (a node
    name that is no hostname, quotas below the kernel's smallest, a delay
    beyond what TCP waits for), or a box option, id, node or rank that does
    not exist. The message names the value and what to change."""


class BoxSetupError(ZorseError, RuntimeError):
    """This machine refused a step of building or removing a box (not root,
    no CAP_NET_ADMIN, no writable cgroup, an ``ip``/``tc`` command that
    failed); the message names the command and the kernel's answer."""


class BoxStateFileError(FileFormatError):
    """A box's state file (``/run/zorse_box/<id>.json``, written by ``zorse
    box up``) is malformed or of an unsupported version. ``zorse box down
    <id>`` still removes the box by its names."""
