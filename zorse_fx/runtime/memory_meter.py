"""The memory a rank's training holds at most, measured, to hold against the plan's prediction.

[Note: measured rank memory]
The plan predicts, per GPU, the bytes of its tensors at the step's peak (``GPUShare.predicted_memory``:
weights, gradients, optimizer state, activations, communication buffers). What a rank measures to hold
against it:

* on a CUDA device: ``torch.cuda.max_memory_allocated`` since the meter was made (just before the stage's
  module is built): the caching allocator's peak of live tensor bytes, the same quantity. Not in it: the
  CUDA context, NCCL's own buffers and the allocator's cached-but-free blocks (``memory_reserved``);
  ``make gpu-check`` measures those against the prediction on a real GPU.
* on the CPU (Gloo; the box's ranks, whose cgroup memory limit stands for a GPU's memory): the growth of
  the process's peak resident set (Linux's VmHWM, set back to the current
  resident set when the meter is made: /proc/self/clear_refs) over its resident set then, less the file
  pages paged in since (torch's libraries' code and data, which the first steps touch: ``RssFile``), so
  Python, torch and the process group are not counted. What it counts besides the stage's tensors: the
  runtime's own anonymous memory (threads' stacks and malloc arenas, Gloo's buffers, glibc's heap kept
  after a free): measured 75-100 MB per rank for a 4-rank plan of the 4 x 128 GPT whose tensors are
  planned at 0.6-17 MB (``zorse train`` of small_hetero's plan, 2026-12-06), a constant a stage of
  hundreds of MB makes small. bench/box.py's case (c) holds it and the cgroup's own peak against the plan.

Both are bytes, one number per rank, monotone over a run (a peak), reported in every step's ``ranks``
records of ``metrics.jsonl`` as ``memory_peak_bytes``.
"""

from __future__ import annotations

import resource
import sys

import psutil
import torch


def _status_bytes(*fields: str) -> int | None:
    """The sum of ``fields`` (``"VmHWM"``, ``"RssFile"``, ...) of /proc/self/status, bytes; None where there
    is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            lines = f.readlines()
    except OSError:
        return None
    return sum(int(line.split()[1]) * 1024 for line in lines if line.split(":", 1)[0] in fields)


def _peak_rss_bytes() -> int:
    """The process's peak resident set, bytes: Linux's VmHWM, which ``_reset_peak_rss`` sets back;
    elsewhere ``ru_maxrss`` (bytes on macOS, KiB on the BSDs). Not ``ru_maxrss`` on Linux: it is also the peak of the
    process's exited threads at their exit, which clear_refs does not reset (measured: a test worker
    whose threads had exited read no growth)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return rss if sys.platform == "darwin" else rss * 1024


def _file_rss_bytes() -> int:
    """Resident file-backed and shared pages of this process, bytes (Linux ``RssFile`` + ``RssShmem``;
    0 elsewhere)."""
    return _status_bytes("RssFile", "RssShmem") or 0


def _reset_peak_rss() -> None:
    """Linux >= 4.0: the peak resident set (VmHWM) set back to the current one (``/proc/self/clear_refs``
    value 5, proc(5)), so a peak before the meter (loading, capture) is not the run's. Elsewhere a no-op."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class MemoryMeter:
    """One rank's memory peak from now on ([Note: measured rank memory]).

    ``device``: the rank's device. ``peak_bytes()`` is, on CUDA, the allocator's peak of live tensor bytes
    since construction; on other devices the growth of the process's peak resident set over its resident
    set at construction (0 if it has not grown).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.base_bytes = 0
        else:
            _reset_peak_rss()
            self.base_bytes = psutil.Process().memory_info().rss
            self.base_file_bytes = _file_rss_bytes()
            self._peak = 0

    def peak_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        # (the code and data of torch's libraries paged in by the first steps: file pages, not the stage's;
        # subtracted as paged in by now, so a later call may compute less: the peak is the most so far)
        now = max(0, _peak_rss_bytes() - self.base_bytes - (_file_rss_bytes() - self.base_file_bytes))
        self._peak = max(self._peak, now)
        return self._peak
