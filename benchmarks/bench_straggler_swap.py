"""What swapping a straggler for a warm spare costs, beside a crash recovery with a warm
spare, and what it gives back.

    python benchmarks/bench_straggler_swap.py [--iters 200] [--slow-from 5] [--factor 3]

Three jobs of the tiny model, DP2 over two in-process "nodes" of one rank each, REFT arc,
snapshots every iteration, one warm spare (tools/launch_nodes.py --restart in-process):

1. swap: rank 1 made --factor times slower from --slow-from, with
   --reft-replace-stragglers (exchanges every 2 iterations, window 2);
2. crash: no slow rank; rank 1 SIGKILLed before its optimizer step of the iteration the
   swap was taken at (its warm spare replaces it, rank 0 restarts in process);
3. baseline: neither (the same launcher and flags).

Printed side by side for the swap and the crash: the downtime (rank 0's wall time from
the end of the last iteration before the restart to the end of the first one after, less
a median iteration of the baseline), rank 0's in-process restart time and its split, the
iterations redone; and the median iteration time of the swap job before the swap (slow),
after it, and of the baseline.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.bench_goodput import TINY as GOODPUT_TINY  # noqa: E402
from reft_ext.report import events as ev  # noqa: E402
from tools.inprocess_launcher import InProcessLauncher  # noqa: E402
from tools.launch_nodes import LaunchConfig  # noqa: E402

# bench_goodput's tiny model, DP2, REFT arc every iteration
TINY = [*GOODPUT_TINY, "--global-batch-size", "4", "--log-interval", "10",
        "--reft-snapshot-every", "1", "--reft-protect", "arc"]


def job(args: list[str], tmp: str) -> tuple[list[dict], list[dict]]:
    """The job's events and the supervisor's history."""
    fd, path = tempfile.mkstemp(prefix="bench-swap-", suffix=".jsonl", dir=tmp)
    os.close(fd)
    cfg = LaunchConfig(nnodes=2, nproc_per_node=1, restart="in-process", spares=1,
                       max_restarts=2, log_dir=tempfile.mkdtemp(dir=tmp, prefix="logs-"))
    with InProcessLauncher(cfg, args, env={ev.ENV: path}).start() as L:
        codes = L.wait(900)
        history = list(L.history)
        if max(codes.values()):
            raise SystemExit(f"bench_straggler_swap: the job failed {codes}:\n"
                             f"{L.outputs()[-4000:]}")
    return ev.read(path), history


def iteration_ends(events: list[dict], rank: int = 0) -> dict[int, float]:
    """Iteration -> when rank ``rank`` last finished it (a redone one: the redo)."""
    return {e["iteration"]: e["time"] for e in events
            if e["event"] == "iteration" and e.get("rank") == rank}


def gaps(ends: dict[int, float], lo: int, hi: int) -> list[float]:
    return [ends[i] - ends[i - 1] for i in range(lo + 1, hi + 1)
            if i in ends and i - 1 in ends]


def median(xs: list[float]) -> float:
    """The median, NaN for no data (a swap taken right after --slow-from, or too near
    --iters to leave iterations after it): printed as "-", never a StatisticsError."""
    return statistics.median(xs) if xs else math.nan


def ms(x: float, width: int = 8) -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{1000 * x:{width}.1f}"


def restart_of(events: list[dict], rank: int = 0) -> dict:
    return next(e for e in events if e["event"] == "inprocess_restart" and e["rank"] == rank)


def downtime(events: list[dict], restart: dict, per_it: float) -> tuple[float, int]:
    """(seconds, iterations redone): the end of the last iteration rank 0 finished before
    its restart began to the end of the first one after, less one median iteration."""
    t_restart = restart["time"] - restart["seconds"]
    done = [e for e in events if e["event"] == "iteration" and e.get("rank") == 0]
    before = [e for e in done if e["time"] < t_restart]
    after = [e for e in done if e["time"] > restart["time"]]
    last, first = before[-1], after[0]
    return first["time"] - last["time"] - per_it, last["iteration"] - restart["iteration"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--slow-from", type=int, default=5)
    p.add_argument("--factor", type=float, default=3.0)
    a = p.parse_args()
    common = [*TINY, "--train-iters", str(a.iters)]
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        base, _ = job(common, tmp)
        swapped, h_swap = job([*common, "--reft-straggler-interval", "2",
                               "--reft-straggler-window", "2", "--reft-replace-stragglers",
                               "--inject-fault", f"1:{a.slow_from}:CONT:slow:{a.factor:g}"],
                              tmp)
        swaps = [e for e in swapped if e["event"] == "straggler_swap"]
        if not swaps:
            raise SystemExit("bench_straggler_swap: no swap happened (a loaded host: rerun)")
        k = swaps[0]["iteration"]
        crashed, h_crash = job([*common, "--inject-fault", f"1:{k}"], tmp)
    per_it = median(gaps(iteration_ends(base), 2, a.iters))
    ends = iteration_ends(swapped)
    slow = median(gaps(ends, a.slow_from + 1, k))
    fast = median(gaps(ends, k + 2, a.iters))
    print(f"straggler swap vs crash, DP2 tiny model, rank 1 {a.factor:g}x slower from "
          f"iteration {a.slow_from}, swapped after iteration {k} (agreed at "
          f"{swaps[0]['agreed']}); baseline median iteration {1000 * per_it:.1f} ms")
    print(f"  {'':<8} {'downtime':>9} {'restart':>8} {'abort':>6} {'wait gen':>8} "
          f"{'rdzv':>6} {'rejoin':>7} {'redone':>6} {'warm':>5}")
    for name, evs, hist in (("swap", swapped, h_swap), ("crash", crashed, h_crash)):
        r = restart_of(evs)
        down, redone = downtime(evs, r, per_it)
        print(f"  {name:<8} {down:8.2f}s {r['seconds']:7.2f}s {r['abort_s']:5.2f}s "
              f"{r['wait_generation_s']:7.2f}s {r['rendezvous_s']:5.2f}s "
              f"{r['rejoin_s']:6.2f}s {redone:6d} {str(hist[0]['warm'][0]):>5}")
    tail = max(k + 2, a.iters - 10)  # the spare refilled by then (its imports share cores)
    last = median(gaps(ends, tail, a.iters))
    crash_ends = iteration_ends(crashed)
    crash_after = median(gaps(crash_ends, k + 2, a.iters))
    base_last = median(gaps(iteration_ends(base), tail, a.iters))
    print(f"  median iteration, ms   {'before':>8} {'after':>8} {'last 10':>8}")
    print(f"  swap job (slow rank)   {ms(slow)} {ms(fast)} {ms(last)}")
    print(f"  crash job              {'':>8} {ms(crash_after)} "
          f"{ms(median(gaps(crash_ends, tail, a.iters)))}")
    print(f"  baseline               {ms(per_it)} {'':>8} {ms(base_last)}")
    print(f"  (after a restart the supervisor starts a new warm spare: its imports share "
          f"this host's cores with the job for a while, in the crash job too)")
    saved = (slow - last) * (a.iters - k)
    if math.isnan(saved):
        print(f"  the swap's gain: not measurable (no iterations before it or after it; "
              f"its line estimated {swaps[0]['saved_s']:.2f} s): a larger --iters")
    else:
        print(f"  the swap gave back {saved:.2f} s over the {a.iters - k} iterations left "
              f"(its line estimated {swaps[0]['saved_s']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
