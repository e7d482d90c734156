"""Goodput accounting that adds up, and what straggler detection costs.

    python benchmarks/bench_goodput.py [--iters 16] [--nproc 2] [--skip-straggler]

1. Accounting: one job (DP over --nproc ranks, REFT arc, snapshots every iteration) that
   crashes (rank 1 SIGKILLed at iteration 4), loses a node (rank 1's, at 8: its shared
   memory wiped) and rolls back a NaN in process (rank 0, at 12), under torchrun with two
   restarts. Printed side by side: every goodput category (the mean of the ranks' final
   records), their sum, the ranks' own wall time taken from other events (each rank's
   first process start, its `startup` event, to its final record) and the launcher's
   wall clock around the whole job (torchrun's own start and exit are outside any rank).
2. Detection: a failure-free run of the same job with rank 1 made 2x slower from
   iteration --slow-from (--inject-fault 1:I:CONT:slow:2) under the default
   --reft-straggler-interval 5 --reft-straggler-window 3: the iterations from the onset
   to the [REFT] straggler line, and the exchanges' time per iteration against the
   median iteration (the detection's cost; the phase clocks are a few perf_counter
   calls per iteration beside it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report import events as ev  # noqa: E402
from reft_ext.report.goodput import CATEGORIES, job_totals  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "2", "--eval-interval", "1000", "--eval-iters", "0"]


def run(nproc: int, args: list[str], restarts: int) -> tuple[list[dict], float, float, str]:
    """The job's events, the launch time, the launcher's wall clock, its output."""
    fd, events = tempfile.mkstemp(prefix="bench-goodput-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO,
               **{ev.ENV: events})
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *TINY,
           "--global-batch-size", str(2 * nproc), *args]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.time() - t0
    out = p.stdout + p.stderr
    try:
        if p.returncode:
            raise SystemExit(f"bench_goodput: the job failed ({p.returncode}):\n{out[-4000:]}")
        return ev.read(events), t0, wall, out
    finally:
        os.unlink(events)


def accounting(a) -> None:
    evs, t0, wall, out = run(a.nproc, [
        "--train-iters", str(a.iters), "--log-interval", "2", "--reft-snapshot-every", "1",
        "--reft-protect", "arc", "--reft-ranks-per-node", "1",
        "--inject-fault", "1:4,1:8:KILL:node:1", "--inject-spike", "0:12:nan"], restarts=2)
    finals = {e["rank"]: e for e in evs if e["event"] == "goodput" and e.get("final")}
    starts = {}
    for e in evs:
        if e["event"] == "startup":
            starts[e["rank"]] = min(starts.get(e["rank"], e["process_start"]),
                                    e["process_start"])
    t = job_totals(list(finals.values()))
    sec = t["seconds"]
    own = statistics.mean(finals[r]["time"] - starts[r] for r in finals)
    first, last = min(starts.values()), max(f["time"] for f in finals.values())
    print(f"accounting: {a.nproc} ranks, {t['attempts']} process attempts, {t['failures']} "
          f"failures (a crash, a lost node), {t['rollbacks']} rollback(s), "
          f"{t['iterations']} iterations kept")
    print(f"  {'category':<16} {'seconds':>9} {'share':>8}")
    for c in CATEGORIES:
        print(f"  {c.replace('_', ' '):<16} {sec[c]:9.3f} {100 * sec[c] / t['wall']:7.2f}%")
    booked = sum(sec.values())
    print(f"  {'sum':<16} {booked:9.3f}")
    print(f"  ranks' wall time from their startup events to their final records: "
          f"{own:.3f} s -> categories off by {100 * (booked - own) / own:+.3f}%")
    print(f"  launcher's wall clock {wall:.3f} s = {first - t0:.3f} s before the first rank "
          f"started (torchrun's start) + {last - first:.3f} s of the ranks + "
          f"{t0 + wall - last:.3f} s after the last final record (exit)")
    line = [ln for ln in out.splitlines() if "[REFT] goodput:" in ln]
    print("  " + (line[0] if line else "(no [REFT] goodput line)"))


def detection(a) -> None:
    slow_from = a.slow_from
    evs, _, _, out = run(a.nproc, [
        "--train-iters", str(a.straggler_iters), "--log-interval", "10",
        "--inject-fault", f"1:{slow_from}:CONT:slow:2"], restarts=0)
    named = [e for e in evs if e["event"] == "straggler"]
    if a.verbose:
        for e in evs:
            if e["event"] == "straggler_exchange":
                print(f"  exchange at {e['iteration']}: busy ms per rank {e['busy_ms']}")
    finals = [e for e in evs if e["event"] == "goodput" and e.get("final")]
    per_it = statistics.median(f["iteration_s"] for f in finals)
    cost = statistics.median(f["exchange_s"] / max(1, f["iterations"]) for f in finals)
    print(f"detection: rank 1 2x slower from iteration {slow_from}, "
          f"{a.straggler_iters} iterations, exchanges every 5, window 3")
    if named:
        n = named[0]
        print(f"  named at iteration {n['iteration']} ({n['iteration'] - slow_from + 1} "
              f"iterations after the onset), rank {n['rank']}, {n['ratio']:.2f}x, costing "
              f"{1000 * n['cost_s']:.1f} ms per iteration")
    else:
        print("  not named (a loaded machine's noise: rerun)")
    print(f"  exchange cost {1e6 * cost:.1f} us per iteration vs the median iteration "
          f"{1000 * per_it:.1f} ms: {100 * cost / per_it:.4f}% (exchanges "
          f"{statistics.median(f['exchanges'] for f in finals):.0f}, median "
          f"{1e6 * statistics.median(f['exchange_s'] / max(1, f['exchanges']) for f in finals):.0f}"
          f" us each)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--straggler-iters", type=int, default=40)
    p.add_argument("--slow-from", type=int, default=8)
    p.add_argument("--skip-straggler", action="store_true")
    p.add_argument("--skip-accounting", action="store_true")
    p.add_argument("--verbose", action="store_true", help="every exchange's rows")
    a = p.parse_args()
    if a.iters < 13:
        p.error("--iters: at least 13 (the rollback is at iteration 12)")
    if not a.skip_accounting:
        accounting(a)
    if not a.skip_straggler:
        detection(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
