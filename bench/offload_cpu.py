"""How close torch's CPU AdamW comes to the memory-bound rate [C-offload] prices.

The planner prices an offloaded optimizer step as memory bound on the host:
2 x optim_bytes (32 B) per parameter at the node's memory bandwidth
(``cluster/host.py``: 204.8 GB/s by default, shared by the node's GPUs).
This benchmark measures, side by side in one process on this machine, with
the thread counts given:

* ``copy``: ``dst.copy_(src)`` over float32 tensors moving the same 32 B per
  parameter (16 B read, 16 B written): the streaming rate of this machine's
  memory as torch sees it;
* ``adamw_foreach`` / ``adamw_fused``: one ``torch.optim.AdamW`` step
  (``foreach=True``, the default on CPU tensors lists, and ``fused=True``)
  over the same parameter count, gradients set, state created by a first
  step (not timed).

It reports the ratio AdamW time / copy time per thread count: how many
times slower than the memory-bound price the CPU step runs here. Proves:
whether the step is memory bound on this CPU at these thread counts (ratio
near 1) or compute bound (ratio well above 1, then [C-offload]'s CPU term is
optimistic by about that ratio). Cannot: stand for a server node (more
cores, more channels, another vendor's vector units; the ratio there is
unknown until measured), or measure PCIe (no GPU here).

Run: ``.venv/bin/python bench/offload_cpu.py`` (about a minute); writes
``bench/results/offload_cpu.json``.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: Parameters per measurement: 2^23 float32 (32 MiB a tensor), far above any cache.
N = 1 << 23
REPEATS = 5


def _best(fn, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    src = [torch.randn(N) for _ in range(4)]
    dst = [torch.empty(N) for _ in range(4)]

    def copy():  # 4 x 4 B read + 4 x 4 B written per parameter = 32 B
        for d, s in zip(dst, src):
            d.copy_(s)

    out = {"threads": threads, "parameters": N, "copy_s": _best(copy)}
    for name, kw in (("adamw_foreach", {"foreach": True}), ("adamw_fused", {"fused": True})):
        p = torch.nn.Parameter(torch.randn(N))
        p.grad = torch.randn(N)
        opt = torch.optim.AdamW([p], lr=1e-3, **kw)
        opt.step()  # creates the moments
        out[f"{name}_s"] = _best(opt.step)
        out[f"{name}_over_copy"] = out[f"{name}_s"] / out["copy_s"]
    return out


def main() -> int:
    rows = [measure(t) for t in (1, 2)]
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads available, "
                         f"torch {torch.__version__}", "rows": rows}
    out = ROOT / "bench" / "results" / "offload_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['threads']} thread(s): AdamW foreach {r['adamw_foreach_over_copy']:.2f}x, "
              f"fused {r['adamw_fused_over_copy']:.2f}x the time of streaming the same 32 B/param")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
