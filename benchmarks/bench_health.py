"""Cost of REFT's node health check (reft_ext/cluster/health.py) and of one hang-detection
heartbeat (reft_ext/cluster/heartbeat.py), the figures of docs/nodes.md.

    python benchmarks/bench_health.py [--nodes 2,3] [--repeats 5] [--matmul-size 256]

Health check: per repeat and node count (interleaved: 2 3 2 3 ...), fresh processes (one
rank per node, gloo over loopback, spawned like torchrun's workers) run the check once
right after init_process_group, as the trainer does at every start. The figure is the
slowest rank's time of the whole check (groups created, matmul, all-gather, verdict), and
its parts: the slowest rank's matmul and the slowest group's all-gather.
Heartbeat: Heartbeat.beat() on a record in /dev/shm, timeit's best of 5 (one beat per
pipeline event when --reft-hang-timeout is on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import timeit

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reft_ext.cluster.health import run_health_check  # noqa: E402
from reft_ext.cluster.heartbeat import Heartbeat  # noqa: E402
from reft_ext.report.files import open_nofollow  # noqa: E402


def _worker(rank, world, store, out, size):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                         world_size=world)
    r = run_health_check(rank, world, 1, matmul_size=size)
    if not r.ok:
        raise SystemExit(f"rank {rank}: the health check failed: {r.lines()}")
    with open_nofollow(os.path.join(out, f"rank{rank}.json")) as f:
        json.dump({"ms": 1000 * r.seconds, "matmul": max(r.matmul_ms.values()),
                   "allgather": max(r.allgather_ms.values(), default=0.0)}, f)
    torch.distributed.destroy_process_group()


def health_once(world: int, size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, size),
                           nprocs=world, start_method="spawn")
        res = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    return {k: max(x[k] for x in res) for k in res[0]}  # the slowest rank's


def heartbeat_us() -> float:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
            as d:
        hb = Heartbeat(d, 0)
        n = 100_000
        return 1e6 * min(timeit.repeat(hb.beat, number=n, repeat=5)) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,3", help="comma list of node counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul-size", type=int, default=256)
    a = ap.parse_args()
    try:
        worlds = [int(x) for x in a.nodes.split(",")]
    except ValueError:
        ap.error(f"--nodes: expected a comma list of integers, got {a.nodes!r}")
    if any(w < 2 for w in worlds):
        ap.error("--nodes: the check needs at least 2 nodes")
    runs = {w: [] for w in worlds}
    for _ in range(a.repeats):
        for w in worlds:
            runs[w].append(health_once(w, a.matmul_size))
    print(f"health check, {a.repeats} interleaved repeats, medians (slowest rank; matmul "
          f"{a.matmul_size}x{a.matmul_size}; loadavg {os.getloadavg()[0]:.1f})")
    print(f"{'nodes':>5} {'check ms':>9} {'matmul ms':>10} {'all-gather ms':>14}   "
          f"every check (ms)")
    for w, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{w:5d} {med['ms']:9.1f} {med['matmul']:10.2f} {med['allgather']:14.2f}   "
              + " ".join(f"{r['ms']:.0f}" for r in rs))
    print(f"heartbeat: {heartbeat_us():.2f} us per beat (best of 5 x 100000)")


if __name__ == "__main__":
    main()
