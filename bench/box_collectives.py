"""The step's world control collectives timed on a box (issue 47; [C-control] in zorse_fx/solve/objective.py).

    sudo .venv/bin/python bench/box_collectives.py [--cluster bench/clusters/box_b_wan_shared.yaml]
        [--scale 0.25] [--reps 12]

Brings up the box of the cluster file (``zorse_fx.box.Box``), starts one Gloo rank per GPU in its node's
namespace (rank order = node order, as ``zorse train`` numbers ranks) and times, each after a barrier,
what ``zorse train`` runs over the whole world every step: the gradient norm's all-reduce of one float32
(``Worker._global_grad_norm``), the all-gather of the per-rank table (13 float64 per rank: [Note: one
world collective after the step] in zorse_fx/train.py), both back to back, the loss all-reduce the
runtime ran before 2026-12-06 on top of them (the old step's three), and a barrier. Prints per
collective the median over the repetitions (the slowest rank's), and what the objective prices for the
pair: ``control_units`` of the cluster's device graph in the box's units (the file's latencies / scale).
Proves: what those collectives cost on real TCP over the box's delays with Gloo. Cannot prove: NCCL's
algorithms (a GPU cluster's tree or ring), nor anything about bandwidth (a few bytes each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_WORKER = r'''
import json, sys, time
import torch
import torch.distributed as dist

rank, world, addr, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29533", rank=rank, world_size=world)
x, row = torch.zeros(1), torch.zeros(13, dtype=torch.float64)


def gather():
    dist.all_gather([torch.empty_like(row) for _ in range(world)], row)


cases = {"norm all-reduce (1 float32)": lambda: dist.all_reduce(x),
         "table all-gather (13 float64 per rank)": gather,
         "norm + table (the step's, since 2026-12-06)": lambda: (dist.all_reduce(x), gather()),
         "norm + loss + table (the step's before)": lambda: (dist.all_reduce(x), dist.all_reduce(x), gather()),
         "barrier": dist.barrier}
out = {}
for name, fn in cases.items():
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "bench" / "clusters" / "box_b_wan_shared.yaml"))
    ap.add_argument("--scale", type=float, default=0.25, help="the box's scale factor (bench/box.py's (b): 0.25)")
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args(argv)

    from zorse_fx.box import Box
    from zorse_fx.cluster import Cluster
    from zorse_fx.ir.costs import BlockCosts
    from zorse_fx.options import PlanOptions
    from zorse_fx.solve.tables import UNIT_S, build_tables, control_units

    cluster = Cluster.from_yaml(args.cluster)
    devices = cluster.device_graph()
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(_WORKER)
        with Box.up(args.cluster, box_id="bench_ctl", scale=args.scale) as box:
            nodes = [devices.node_names[g] for g in range(devices.num_gpus)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs = [box.spawn(node, [sys.executable, str(worker), str(r), str(len(nodes)), nodes[0], str(args.reps)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                     for r, node in enumerate(nodes)]
            results = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    # The objective's price in box seconds: the file's latencies / scale.
    costs = BlockCosts(fwd_bwd_s_per_sample={t: (0.0,) for t in set(devices.gpu_types)}, param_count=(0,),
                       act_bytes_per_sample=(0,), cut_bytes_per_sample=(0, 0), step_control_rounds=3)
    tab = build_tables(costs, devices, PlanOptions(global_batch_size=devices.num_gpus), 1)
    priced = control_units(tab, range(devices.num_gpus)) * UNIT_S / args.scale
    print(f"{cluster.name}: {len(nodes)} ranks (one per GPU, node order), Gloo, box scale {args.scale:g}, "
          f"{args.reps} repetitions each after a barrier")
    for name in results[0]:
        slowest = [max(r[name][k] for r in results) for k in range(args.reps)]
        print(f"  {name:<46} median {statistics.median(slowest):.3f} s  "
              f"(range {min(slowest):.3f}-{max(slowest):.3f})")
    print(f"  priced ([C-control], r = 3: the norm's all-reduce + the table's all-gather): {priced:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
