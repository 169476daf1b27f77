"""Every CP-SAT solve in a forked child, so that an OR-Tools abort costs one try, not the process.

[Note: isolated solves]
Besides its presolve bug ([Note: presolve bug] in ``_search.py``), OR-Tools 9.15 can abort the whole process: an uncaught
``std::out_of_range: absl::btree_map::at`` in SolutionCrush during presolve
with a complete hint (google/or-tools#5288, fixed on main, in no PyPI release
yet). It can kill a scenario benchmark run (FlashFlex), and a planner must
not take the user's training launch down with it. So where the
OS can fork, every CP-SAT solve runs in a forked child (``run_isolated``):
the child solves and reads the answer off its solver (status, bound, the
objective and the decision; all plain tuples), pickles it into a pipe and
exits with ``os._exit``. If the child dies instead, the parent gets
``SolverCrash`` (naming the signal) and the candidate is solved again without
its hint, then also without presolve; a candidate that crashes all three
times is recorded as ``"status": "CRASHED"`` (like a time-limited UNKNOWN: no
solution, the throughput bound, and the search is no longer OPTIMAL). A
hinted candidate completes its hint (``_search.complete_hint``) in the same child,
so a candidate costs one fork: ~20 ms with torch loaded (copy-on-write page
tables; measured on the 2-core CPU machine). Set ``ZORSE_SOLVE_IN_PROCESS=1``
to solve in-process (e.g. under a debugger).
"""

from __future__ import annotations

import os
import pickle
import select
import signal

__all__ = ["SolverCrash", "IN_PROCESS_MAX_GPUS", "default_jobs", "map_isolated", "options_jobs", "run_isolated",
           "start_isolated", "start_isolated_batch", "work_jobs"]

#: Clusters of at most this many GPUs run the search's independent Python work in this process by default
#: (``work_jobs``; [Note: small searches in process]).
IN_PROCESS_MAX_GPUS = 64


def default_jobs() -> int:
    """``PlanOptions.jobs``' default: ``ZORSE_JOBS`` where set (the test suite sets 1: its
    workers already fill the cores), else the cores this process may run on
    (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    env = os.environ.get("ZORSE_JOBS", "")
    if env.strip():
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"ZORSE_JOBS={env!r}: use a whole number of processes >= 1, or unset it") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def options_jobs(options) -> int:
    """The processes side by side for ``options`` (a ``PlanOptions``): its ``jobs``, else
    ``default_jobs()``."""
    return options.jobs if options.jobs is not None else default_jobs()


def work_jobs(options, num_gpus: int) -> int:
    """The processes side by side for the search's independent Python work on ``num_gpus`` GPUs (the
    portfolio's heuristics, the stage DP's DPs, the interleave search's tries, the simulator's finalists:
    ``map_isolated``): ``options.jobs`` or ``$ZORSE_JOBS`` where given, else 1 (this process) up to
    ``IN_PROCESS_MAX_GPUS`` GPUs and the cores beyond ([Note: small searches in process]). CP-SAT solves
    are forked whatever this says ([Note: isolated solves]).

    [Note: small searches in process]
    Forking costs the parent and child of a ~1.2 GB planner (the model's weights, the captured graph) a
    page-table copy and copy-on-write faults: 27 ms for a bare fork after capture, ~90,000 minor faults
    over the README's plan's heuristic forks (bench/plan_cli.py, 2026-12-07). The heuristics of a cluster
    up to 64 GPUs take 0.3-0.7 CPU s in one process and 0.8-1.3 forked two at a time, with no shorter a
    wall clock on the 2-core machine (demo.yaml 0.30 against 0.95 CPU s; metis.yaml, 8 GPUs, 0.65 against
    1.1; amp.yaml, 16, 0.68 against 1.1; zorse_a.yaml, 20, 0.31 against 0.81; flashflex.yaml, 32, 0.66
    against 1.2; zorse_b.yaml, 64, 0.58 against 1.2: SmolLM2-135M, batch 32). ``map_isolated`` gives the
    same answers for every ``jobs``, so the rule changes seconds only, never a plan."""
    if options.jobs is not None or os.environ.get("ZORSE_JOBS", "").strip():
        return options_jobs(options)
    return 1 if num_gpus <= IN_PROCESS_MAX_GPUS else default_jobs()


class SolverCrash(RuntimeError):
    """A CP-SAT solve killed its (forked) process; see [Note: isolated solves]."""


def _in_process() -> bool:
    return not hasattr(os, "fork") or os.environ.get("ZORSE_SOLVE_IN_PROCESS", "") not in ("", "0")


def run_isolated(fn):
    """``fn()`` run in a forked child process; returns its (picklable) result.

    An exception raised by ``fn`` is re-raised here (its repr, as a
    RuntimeError, if it cannot be pickled). Raises ``SolverCrash`` when the
    child dies without answering (e.g. OR-Tools' abort, SIGABRT). Runs ``fn``
    in this process where the OS cannot fork or ``ZORSE_SOLVE_IN_PROCESS=1``.
    See [Note: isolated solves]."""
    return start_isolated(fn).result()


class _Isolated:
    """A started ``run_isolated`` call: ``result()`` waits for it (see ``start_isolated``)."""

    def __init__(self, fn):
        self.done, self.value, self.error = False, None, None
        if _in_process():
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001 -- re-raised by result()
                self.error = exc
            self.done = True
            return
        self.pid, self.fd = _fork_child(fn)

    def result(self):
        """The child's result (or its exception, re-raised; ``SolverCrash`` if it died)."""
        if not self.done:
            self.done = True
            try:
                self.value = _collect_child(self.pid, self.fd)
            except BaseException as exc:  # noqa: BLE001 -- kept for every later call
                self.error = exc
        if self.error is not None:
            raise self.error
        return self.value


def start_isolated(fn) -> _Isolated:
    """Start ``fn()`` in a forked child and return at once; ``.result()`` waits for it
    and returns (or raises) what ``run_isolated(fn)`` would. Several started children
    run side by side on the machine's cores (the ``jobs`` of ``CandidateSearch.run``)."""
    return _Isolated(fn)


class _Done:
    """A try already answered (``start_isolated_batch``): ``result()`` returns or raises as ``_Isolated``'s."""

    def __init__(self, ok: bool, value):
        self.ok, self.value = ok, value

    def result(self):
        if not self.ok:
            raise self.value
        return self.value


class _Batch:
    """A started ``start_isolated_batch`` call: ``results()`` waits for its child."""

    def __init__(self, fns):
        self.n, self.out = len(fns), None
        if _in_process():
            self.out = []
            for fn in fns:
                try:
                    self.out.append(_Done(True, fn()))
                except BaseException as exc:  # noqa: BLE001 -- re-raised by its result()
                    self.out.append(_Done(False, exc))
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: one framed answer per call, in order, never return into the caller's stack
            code = 1
            try:
                os.close(r)
                with os.fdopen(w, "wb") as f:
                    for fn in fns:
                        payload = _answer(fn)
                        f.write(len(payload).to_bytes(8, "little") + payload)
                        f.flush()
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self.fd = pid, r

    def results(self) -> list:
        """Per call, in order: a finished try (its ``result()`` returns the value or raises the call's
        exception; ``SolverCrash`` for the call the child died in) or None for a call never started
        (after a crash)."""
        if self.out is None:
            with os.fdopen(self.fd, "rb") as f:
                data = f.read()
            _, status = os.waitpid(self.pid, 0)
            out, at = [], 0
            while at + 8 <= len(data) and len(out) < self.n:
                size = int.from_bytes(data[at:at + 8], "little")
                if at + 8 + size > len(data):
                    break
                ok, value = pickle.loads(data[at + 8:at + 8 + size])
                out.append(_Done(ok, value))
                at += 8 + size
            if len(out) < self.n:  # the child died in call len(out)
                out.append(_Done(False, SolverCrash(
                    f"the CP-SAT solve in child process {self.pid} died with {_how(status)} without an answer")))
            self.out = out + [None] * (self.n - len(out))
        return self.out


def start_isolated_batch(fns) -> _Batch:
    """Start ``fns`` one after another in ONE forked child and return at once; ``.results()`` gives per
    call what ``start_isolated(fn).result()`` would have returned or raised, or None for the calls
    after one that killed the child (to be started again). One fork for several tries: [Note: tries
    batched per child] in ``_search.py``. In this process where ``run_isolated`` would be."""
    return _Batch(list(fns))


def map_isolated(fns, jobs: int) -> list[tuple[bool, object]]:
    """Each of ``fns`` run as ``run_isolated`` would, up to ``jobs`` forked children
    side by side, a new one started as soon as any finishes; returns, in the order of
    ``fns`` (whatever the completion order), ``(True, value)`` or ``(False, exception)``
    per call (``SolverCrash`` for a child that died). With ``jobs`` <= 1, or where
    ``run_isolated`` runs in this process, the calls run here one after another, so
    the values are those of ``jobs`` = 1. Used for independent deterministic work
    (the portfolio's heuristics, the simulator's finalists): ``jobs`` buys wall-clock
    time, never a different answer."""
    out: list[tuple[bool, object] | None] = [None] * len(fns)
    if jobs <= 1 or _in_process():
        for i, fn in enumerate(fns):
            try:
                out[i] = (True, fn())
            except Exception as exc:  # noqa: BLE001 -- handed back to the caller, as from a child
                out[i] = (False, exc)
        return out
    pending, running = list(range(len(fns))), {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                i = pending.pop(0)
                child = _Isolated(fns[i])
                running[child.fd] = (i, child)
            ready, _, _ = select.select(list(running), [], [])
            for fd in sorted(ready):
                i, child = running.pop(fd)
                try:
                    out[i] = (True, child.result())
                except Exception as exc:  # noqa: BLE001 -- as above
                    out[i] = (False, exc)
    finally:  # interrupted: no child left behind
        for _, child in running.values():
            try:
                os.kill(child.pid, signal.SIGKILL)
                child.result()
            except Exception:  # noqa: BLE001,S110 -- already gone
                pass
    return out


def _answer(fn) -> bytes:
    """In a child: ``fn()`` as the pickled ``(True, value)``, or ``(False, exception)`` for whatever it raised
    (its repr as a RuntimeError where the exception does not pickle)."""
    try:
        return pickle.dumps((True, fn()))
    except BaseException as exc:  # noqa: BLE001 -- everything goes back to the parent
        try:
            return pickle.dumps((False, exc))
        except Exception:  # noqa: BLE001
            return pickle.dumps((False, RuntimeError(repr(exc))))


def _fork_child(fn) -> tuple[int, int]:
    """Fork a child that sends ``fn()``'s pickled (ok, value) through a pipe; (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: answer through the pipe, never return into the caller's stack
        code = 1
        try:
            os.close(r)
            payload = _answer(fn)
            with os.fdopen(w, "wb") as f:
                f.write(payload)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect_child(pid: int, r: int):
    """Read a forked child's answer and reap it (``_fork_child``); its value, or raise."""
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        ok, value = pickle.loads(data)
    except Exception:  # noqa: BLE001 -- nothing, or a payload cut short: the child died
        raise SolverCrash(f"the CP-SAT solve in child process {pid} died with {_how(status)} without an "
                          f"answer") from None
    if not ok:
        raise value
    return value


def _how(status: int) -> str:
    """How a child with wait ``status`` ended: "signal 6 (SIGABRT)" or "exit status 1"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"
