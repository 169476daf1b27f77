"""Communication profiles: point-to-point and all-reduce times fitted per link class.

Model (Hockney, "The communication challenge for MPP: Intel Paragon and Meiko
CS-2", Parallel Computing 20(3), 1994)::

    time_s = alpha_s + bytes * beta,   beta = 1 / bandwidth_bytes_per_s

``alpha_s`` is the latency (seconds), ``bandwidth_bytes_per_s`` the asymptotic
bandwidth (bytes/s; 1 GB/s = 1e9 bytes/s, the cluster YAML's ``bandwidth_GBps``).

Link class of a rank pair: ``intra_node`` (same host: ``socket.gethostname()``,
told apart by torchrun's ``GROUP_RANK`` when several nodes share one name),
``inter_node`` (different hosts, same or unknown datacenter),
``cross_datacenter`` (both ranks were launched with ``--datacenter`` and the
names differ; this cannot be detected automatically).

* ``p2p``: one-way time = ping-pong round trip / 2 between a rank pair.
* ``allreduce``: SUM over the whole world; time of the slowest rank. Its
  ``link_class`` is the widest class present in the world. Its
  ``bandwidth_bytes_per_s`` is the algorithm bandwidth (bytes / time
  asymptote); ``bus_bandwidth_bytes_per_s`` follows nccl-tests
  (doc/PERFORMANCE.md): ``busbw = algbw * 2 (n - 1) / n`` for all-reduce,
  ``busbw = algbw`` for send/recv.

JSON: ``{"format": "zorse_fx.comm_profile", "version": 1, "harness_version", "backend",
"world_size", "hosts": [per rank], "datacenters": [per rank, '' = unknown], "device",
"torch_version", "measured_at": "2026-11-22T06:10:00Z", "fits": [{"link_class", "op",
"ranks", "alpha_s", "bandwidth_bytes_per_s", "bus_bandwidth_bytes_per_s" (derived, ignored
when loading), "r2", "samples": [[bytes, seconds], ...]}, ...]}``.

The format is declared once, on ``CommProfile`` and ``LinkFit``: their
annotations carry each field's type, range, allowed values and meaning, and
``file_schema.struct_of`` builds the schema (``CommProfileDoc``) from them
(plus the file-only ``format``, ``version`` and ``bus_bandwidth_bytes_per_s``).
``CommProfile.load`` / ``from_dict`` check a file against it
(``COMM_PROFILE_FILE``: unknown fields refused), then the rules tying fields
together (one host per rank, numbers finite); every error is a
``CommProfileError`` (a ``FileFormatError`` and a ``ValueError``) naming the
file, the field path (``fits[0].alpha_s``), the value and the fix.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from msgspec import Meta

from zorse_fx.errors import FileFormatError
from zorse_fx.file_schema import OPTIONAL, FileFormat, from_doc, struct_of, to_builtins

__all__ = ["HARNESS_VERSION", "LINK_CLASSES", "OPS", "CommProfileError", "LinkFit", "CommProfile", "CommProfileDoc",
           "COMM_PROFILE_FILE", "fit_alpha_beta", "classify_pair", "measure"]

HARNESS_VERSION = "1"
FORMAT = "zorse_fx.comm_profile"
FORMAT_VERSION = 1
LINK_CLASSES = ("intra_node", "inter_node", "cross_datacenter")  # narrowest to widest
OPS = ("p2p", "allreduce")


class CommProfileError(FileFormatError):
    """A communication profile file (or dict) is missing, malformed or of an
    unsupported version (a ``FileFormatError``: ``path``, ``field`` and
    ``value`` name the file, the field and the value)."""


def fit_alpha_beta(samples: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """Fit ``seconds = alpha + bytes * beta``; return ``(alpha_s, bandwidth_bytes_per_s, r2)``.

    Least squares on *relative* residuals, i.e. weights ``1 / seconds**2``:
    minimise ``sum(((t - alpha - beta * b) / t) ** 2)``. Timing noise grows with
    the time, and sizes span several decades; plain least squares would let
    the largest messages decide ``alpha`` alone (its error would be far above
    a real latency). Noise-free linear data is recovered exactly either way.
    ``r2`` is the coefficient of determination of that weighted fit.

    ``alpha >= 0``: if the fit gives a negative intercept (the smallest
    messages are faster than the line says: latency below what the data
    resolve), alpha is clipped to 0 and beta refitted through the origin with
    the same weights. Raises ``ValueError`` for fewer than 2 samples, fewer
    than 2 distinct sizes, a size <= 0, a time <= 0 or not finite, or times
    that do not grow with size (beta <= 0: add larger messages).
    """
    pts = [(b, t) for b, t in samples]
    if len(pts) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 (bytes, seconds) samples, got {len(pts)}")
    for b, t in pts:
        if not (isinstance(b, (int, np.integer)) and not isinstance(b, bool)) or b <= 0:
            raise ValueError(f"fit_alpha_beta: message size must be a positive integer number of bytes, got {b!r}")
        if not (isinstance(t, (int, float, np.floating)) and math.isfinite(t) and t > 0):
            raise ValueError(f"fit_alpha_beta: time for {b} bytes must be a finite number of seconds > 0, got {t!r}")
    x, y = (np.array(col, dtype=np.float64) for col in zip(*pts))
    if len(np.unique(x)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 distinct message sizes, got only {int(x[0])} bytes")
    scale = x.max()  # sizes in units of the largest one: a well-conditioned system
    xs, w = x / scale, 1.0 / y
    (alpha, beta_s), *_ = np.linalg.lstsq(np.stack([w, xs * w], axis=1), y * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta_s = float(np.sum(w * w * xs * y) / np.sum(w * w * xs * xs))
    beta = beta_s / scale
    if not beta > 0:
        raise ValueError(
            f"fit_alpha_beta: times do not grow with message size (fitted bytes/s <= 0) over sizes "
            f"{int(x.min())}..{int(x.max())} bytes; measure larger messages")
    wt = w * w
    mean = np.sum(wt * y) / np.sum(wt)
    ss_res, ss_tot = float(np.sum(wt * (y - alpha - beta * x) ** 2)), float(np.sum(wt * (y - mean) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return float(alpha), float(1.0 / beta), float(r2)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """Alpha-beta fit of one op over one link class.

    ``samples``: ``(bytes, seconds)`` medians, sorted by size (several pairs of
    one class contribute one sample per size each). ``ranks``: ranks the op
    spans (2 for ``p2p``, the world for ``allreduce``).
    """

    link_class: Literal[LINK_CLASSES]  # type: ignore[valid-type]
    op: Literal[OPS]  # type: ignore[valid-type]
    ranks: Annotated[int, Meta(ge=2, description="ranks the op spans: 2 for p2p, the world for allreduce")] = 2
    alpha_s: Annotated[float, Meta(ge=0, description="latency, seconds >= 0")]
    bandwidth_bytes_per_s: Annotated[float, Meta(gt=0, description="asymptotic bandwidth, bytes/s > 0")]
    r2: Annotated[float, Meta(description="the fit's coefficient of determination, a finite number")]
    samples: Annotated[tuple[tuple[Annotated[int, Meta(gt=0)], Annotated[float, Meta(gt=0)]], ...], Meta(
        description="a list of [bytes > 0, seconds > 0] pairs")]

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """nccl-tests bus bandwidth (doc/PERFORMANCE.md): all-reduce ``algbw * 2(n-1)/n``; p2p ``algbw``."""
        n = self.ranks
        return self.bandwidth_bytes_per_s * (2 * (n - 1) / n if self.op == "allreduce" else 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommProfile:
    """Measured communication of one launch (see the module docstring for the JSON)."""

    harness_version: str
    backend: Annotated[str, Meta(description="the torch.distributed backend, such as 'gloo' or 'nccl'")]
    world_size: Annotated[int, Meta(ge=1, description="ranks of the launch")]
    hosts: Annotated[tuple[str, ...], Meta(description="one host name per rank")]
    datacenters: Annotated[tuple[str, ...], Meta(description="one datacenter name per rank ('' = unknown), or "
                                                             "none")] = field(default=(), metadata=OPTIONAL)
    device: str
    torch_version: str
    measured_at: Annotated[str, Meta(description="an ISO 8601 date-time string")]
    fits: tuple[LinkFit, ...]

    def fit(self, link_class: str, op: str = "p2p") -> LinkFit:
        """The fit of ``op`` over ``link_class``; ``ValueError`` if it was not measured."""
        for f in self.fits:
            if f.link_class == link_class and f.op == op:
                return f
        have = ", ".join(f"{f.op}/{f.link_class}" for f in self.fits) or "nothing"
        raise ValueError(f"no {op} measurement for link class {link_class!r} in this profile (measured: {have})")

    def link_yaml(self, link_class: str) -> dict[str, float]:
        """Cluster-YAML link entry ``{bandwidth_GBps, latency_us}`` from the ``p2p`` fit of ``link_class``."""
        f = self.fit(link_class, "p2p")
        return {"bandwidth_GBps": float(f"{f.bandwidth_bytes_per_s / 1e9:.4g}"),
                "latency_us": float(f"{f.alpha_s * 1e6:.4g}")}

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict of this profile (the file's content), keys in
        the schema's order; each fit adds its ``bus_bandwidth_bytes_per_s``."""
        return to_builtins(self, CommProfileDoc, _file_only)

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> CommProfile:
        """Parse ``to_dict`` output; ``CommProfileError`` (a ``ValueError``) names source, field and value."""
        return _build(COMM_PROFILE_FILE.decode(d, source), source)

    def save(self, path: str | Path) -> Path:
        """Write ``to_dict`` to ``path`` (JSON, indent 1; parent directories made); returns ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CommProfile:
        """The profile in the JSON file ``path``. Raises CommProfileError: no
        such file, not JSON, or a field the schema or ``_build`` refuses."""
        _, doc = COMM_PROFILE_FILE.read(path, missing="create one with `zorse bench comm`")
        return _build(doc, str(path))


def _file_only(record: Any) -> dict:
    """The fields a profile file holds that the records do not (``bus_bandwidth_bytes_per_s`` is derived)."""
    if isinstance(record, CommProfile):
        return {"format": FORMAT, "version": FORMAT_VERSION}
    if isinstance(record, LinkFit):
        return {"bus_bandwidth_bytes_per_s": record.bus_bandwidth_bytes_per_s}
    return {}


LinkFitDoc = struct_of(LinkFit, "LinkFitDoc", extra={
    "bandwidth_bytes_per_s": [("bus_bandwidth_bytes_per_s", Annotated[float | None, Meta(
        description="derived from bandwidth_bytes_per_s and ranks; ignored when loading")], None)],
})
CommProfileDoc = struct_of(CommProfile, "CommProfileDoc", docs={LinkFit: LinkFitDoc}, extra={
    "": [("format", Literal["zorse_fx.comm_profile"], msgspec.NODEFAULT), ("version", Literal[1], msgspec.NODEFAULT)],
})

#: A communication profile as a ``file_schema.FileFormat``.
COMM_PROFILE_FILE = FileFormat(name=FORMAT, what="communication profile", doc=CommProfileDoc,
                               versions=(FORMAT_VERSION,), remake="re-run `zorse bench comm`", error=CommProfileError)


def _build(doc: Any, source: str) -> CommProfile:
    """The profile of ``doc`` (a checked ``CommProfileDoc``) after the rules
    the schema cannot state: one host per rank, one datacenter per rank (or
    none), every time and bandwidth finite. Raises CommProfileError."""
    world = doc.world_size
    if len(doc.hosts) != world:
        raise COMM_PROFILE_FILE.field_error(source, ["hosts"], list(doc.hosts), f"a list of {world} host names "
                                            f"(one per rank of world_size {world})")
    if len(doc.datacenters) not in (0, world):
        raise COMM_PROFILE_FILE.field_error(source, ["datacenters"], list(doc.datacenters),
                                            f"a list of {world} datacenter names ('' = unknown), or none")
    for i, f in enumerate(doc.fits):
        for name in ("alpha_s", "bandwidth_bytes_per_s", "r2"):
            if not math.isfinite(getattr(f, name)):
                raise COMM_PROFILE_FILE.field_error(source, ["fits", i, name], getattr(f, name), "a finite number")
        for j, (_, t) in enumerate(f.samples):
            if not math.isfinite(t):
                raise COMM_PROFILE_FILE.field_error(source, ["fits", i, "samples", j, 1], t,
                                                    "a finite number of seconds")
    return from_doc(doc, CommProfile)


def fit_or_bound(samples: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``fit_alpha_beta``, or, where noise swamps the size dependence (latency-bound
    sizes, a busy host), a bounded estimate flagged by ``r2 = 0``: alpha = the fastest
    time (s), bandwidth = the largest message / its time (bytes/s). A measurement run
    then reports a weak fit instead of failing."""
    try:
        return fit_alpha_beta(samples)
    except ValueError:
        alpha = min(t for _, t in samples)
        size, t = max(samples)
        return alpha, size / t, 0.0

def classify_pair(host_a: str, host_b: str, dc_a: str = "", dc_b: str = "") -> str:
    """Link class of two ranks from their host names and (optional, may be '') datacenter names."""
    if dc_a and dc_b and dc_a != dc_b:
        return "cross_datacenter"
    return "intra_node" if host_a == host_b else "inter_node"


# ---------------------------------------------------------------- measurement (inside each rank)

def _timer(device: torch.device):
    """``perf_counter`` that first waits for the GPU stream (on CPU, plain ``perf_counter``)."""
    cuda = device.type == "cuda"
    return (lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]) if cuda else time.perf_counter


def _sync(device: torch.device) -> None:
    """All ranks meet (a one-element all-reduce; on GPU also waits for the stream)."""
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pingpong(peer: int, initiator: bool, buf: torch.Tensor, now) -> float:
    """One round trip (seconds, as seen by this rank): the initiator sends then receives."""
    t0 = now()
    if initiator:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)
    return now() - t0


def measure(sizes: Sequence[int], *, iters: int, warmup: int = 3, datacenter: str = "",
            all_pairs: bool = False, device: torch.device | None = None) -> CommProfile | None:
    """Measure and fit on every rank of the initialised process group; rank 0 gets the profile, others None.

    ``sizes`` in bytes (multiples of 4: float32 buffers). Ping-pong runs on one
    representative pair per link class (the two lowest ranks of that class), or
    on every pair with ``all_pairs``. Rounds are interleaved (each round times
    every size once) so a burst of load on the host hits one round of many
    sizes rather than every iteration of one size; each sample is the median
    over ``iters`` timed rounds after ``warmup`` untimed ones. All-reduce
    iterations start together (a one-element all-reduce before each) and take
    the slowest rank's time.
    """
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise ValueError(f"message sizes must be multiples of 4 bytes (float32 buffers), >= 4; got {list(sizes)}")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    now, rounds = _timer(device), warmup + iters
    info: list[Any] = [None] * world
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dist.all_gather_object(info, (socket.gethostname(), os.environ.get("GROUP_RANK", "0"), datacenter, name))
    hn, groups, dcs, names = (tuple(col) for col in zip(*info))
    shared = len(set(zip(hn, groups))) > len(set(hn))  # one host name on several torchrun nodes (containers)
    hosts = tuple(f"{h}#node{g}" if shared else h for h, g in zip(hn, groups))
    pairs: dict[str, list[tuple[int, int]]] = {}
    for a in range(world):
        for b in range(a + 1, world):
            cls = classify_pair(hosts[a], hosts[b], dcs[a], dcs[b])
            if all_pairs or cls not in pairs:
                pairs.setdefault(cls, []).append((a, b))
    bufs = [torch.zeros(s // 4, dtype=torch.float32, device=device) for s in sizes]
    raw: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for cls in (c for c in LINK_CLASSES if c in pairs):
        for a, b in pairs[cls]:
            _sync(device)
            if rank in (a, b):
                rt = [[_pingpong(b if rank == a else a, rank == a, buf, now) for buf in bufs] for _ in range(rounds)]
                if rank == a:  # one-way = round trip / 2
                    raw.setdefault((cls, "p2p"), []).extend(
                        (s, statistics.median(r[j] for r in rt[warmup:]) / 2) for j, s in enumerate(sizes))
    times = torch.zeros(rounds, len(sizes), dtype=torch.float64)
    for i in range(rounds if world > 1 else 0):
        for j, buf in enumerate(bufs):
            _sync(device)
            t0 = now()
            dist.all_reduce(buf)
            times[i, j] = now() - t0
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0 and world > 1:
        widest = max(pairs, key=LINK_CLASSES.index)
        raw[(widest, "allreduce")] = [(s, statistics.median(slowest[warmup:, j].tolist())) for j, s in enumerate(sizes)]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, raw)  # p2p samples live on each pair's initiator
    if rank != 0:
        return None
    merged: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for part in gathered:
        for key, pts in part.items():
            merged.setdefault(key, []).extend(pts)
    fits = []
    for cls in LINK_CLASSES:
        for op in OPS:
            pts = sorted(merged.get((cls, op), ()))
            if pts:
                alpha, bw, r2 = fit_or_bound(pts)
                fits.append(LinkFit(link_class=cls, op=op, alpha_s=alpha, bandwidth_bytes_per_s=bw, r2=r2,
                                    samples=tuple(pts), ranks=world if op == "allreduce" else 2))
    return CommProfile(
        harness_version=HARNESS_VERSION, backend=dist.get_backend(), world_size=world, hosts=hosts,
        datacenters=dcs, device=" + ".join(dict.fromkeys(names)), torch_version=torch.__version__,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), fits=tuple(fits))
