"""The box's TCP tuning: the sysctls every node namespace gets ([Note: the box's TCP tuning]).

``tcp_sysctls(pairs)`` is what ``layout.plan_box`` records in ``BoxLayout.tcp_sysctls`` and
``net.add_namespaces`` writes into each node's namespace (the host's own settings untouched).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layout import PairLink

__all__ = ["TCP_BUFFER_MAX", "tcp_sysctls"]

# [Note: the box's TCP tuning]
# One TCP flow carries at most its window per round trip. With the kernel's defaults (tcp_wmem's
# largest send buffer 4 MiB) a flow over the box's (b) WAN (31 MB/s, 400 ms round trip: a
# bandwidth-delay product of 12.5 MB) carried 4 MiB messages at 10 MB/s (`zorse bench comm`,
# 191 ms + 10.1 MB/s fitted over 4 KiB-4 MiB); with buffers up to 32 MiB, 200 ms + 19.4 MB/s
# (bench/LOG.md "The box's WAN: TCP windows and Gloo's rendezvous", 2026-12-07). And after an
# idle gap longer than its retransmission timeout a connection starts again from a small window
# (tcp_slow_start_after_idle = 1, RFC 2861's congestion window validation): back-to-back
# messages never idle (the fits above were the same with it 0 or 1), a pipeline's boundary
# messages do. Hosts that train across regions are tuned for long fat networks the way
# data-transfer hosts are: ESnet's Linux host tuning (fasterdata.es.net/host-tuning/linux/)
# raises tcp_rmem/tcp_wmem's maximum to cover the path's bandwidth-delay product, and disabling
# slow start after idle is the standard advice for long-lived connections (I. Grigorik, High
# Performance Browser Networking, O'Reilly 2013, ch. 2). The box does both in every node's
# namespace (per-namespace sysctls; the host's own settings are untouched): buffers that
# autotune up to twice the largest bandwidth-delay product of its pairs (round trip = the two
# directions' delays), a power of two, at least 8 MiB (above the kernels' usual 4 MiB send /
# 6 MiB receive maximum), at most 256 MiB. `zorse box up --no-tcp-tuning` keeps the kernel's
# defaults, to measure an untuned host.

TCP_BUFFER_MAX = 256 << 20


def tcp_sysctls(pairs: Sequence[PairLink]) -> tuple[tuple[str, str], ...]:
    """The node namespaces' TCP sysctls for ``pairs`` ([Note: the box's TCP tuning]): ``tcp_rmem`` and
    ``tcp_wmem`` whose maximum is 2 x the largest bandwidth-delay product (bytes/s x round trip, rounded up to
    a power of two, between 8 MiB and ``TCP_BUFFER_MAX``), and ``tcp_slow_start_after_idle`` = 0."""
    delay = {(p.src, p.dst): p.delay_s for p in pairs}
    bdp = max((p.bytes_per_s * (p.delay_s + delay.get((p.dst, p.src), p.delay_s)) for p in pairs), default=0.0)
    buf = max(8 << 20, min(TCP_BUFFER_MAX, 1 << max(0, math.ceil(math.log2(max(2 * bdp, 1.0))))))
    return (("net.ipv4.tcp_rmem", f"4096 131072 {buf}"), ("net.ipv4.tcp_wmem", f"4096 16384 {buf}"),
            ("net.ipv4.tcp_slow_start_after_idle", "0"))
