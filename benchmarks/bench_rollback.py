"""Cost of a loss-spike rollback: in process from host memory vs the field's practice of
restarting from the newest persistent checkpoint, timed the same way in one run.

    python benchmarks/bench_rollback.py [--layers 8 --hidden 256] [--repeats 3]

Both sides go from "the spike at iteration 10 is known" to "iteration 9 is complete
again" on the default job's layout (TP1 x PP2 x DP2, ZeRO-1, --reft-protect arc,aor,
snapshots every iteration, end-of-iteration schedule so the log shows each iteration as
it ends), wall clock from when lines appear on the job's output:

* rollback: the job runs with --inject-spike 1:10 --reft-rollback-on spike; from the
  detection (the [REFT] rollback line's time minus the rollback's own milliseconds) to
  the log line of iteration 9 after it (REFT-load in process, data iterators rebuilt,
  one iteration of compute).
* persistent: the state of iteration 8 saved by a preparatory run (--save, torch_dist);
  from the launch of `torchrun ... --load` (a restart; stopping the old job and noticing
  the spike are not counted, which favours this side) to the log line of iteration 9.

The runs are interleaved (rollback, persistent, rollback, ...); medians and their ratio
are printed, with the pure load times beside them, timed the same way on both sides by
the trainer: the clock starts after a barrier and the figure is the slowest rank's (the
REFT-load inside the rollback, its `[REFT] recovery:` line; the torch_dist load, its files
in the page cache as the preparatory run left them).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.progress import Progress  # noqa: E402

ROLLBACK = re.compile(r"\[REFT\] rollback: .* restored from host memory in ([\d.]+) ms")
# REFT-load inside the rollback, as reft_ext/load/recover.py times it (barrier, slowest rank)
REFT_LOAD = re.compile(r"\[REFT\] recovery: iteration \d+ restored on \d+ ranks from .* in "
                       r"([\d.]+) ms")
LOAD = re.compile(r"loaded checkpoint .* at iteration 8 \[([\d.]+) s, slowest rank\]")
ITER9 = re.compile(r" iteration +9/")


def job(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", "8", "--num-query-groups", "4",
            "--ffn-hidden-size", str(4 * a.hidden), "--seq-length", "128",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--micro-batch-size", "2", "--global-batch-size", "16",
            "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
            "--lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000"]


def launch(args: list[str]) -> list[tuple[float, str]]:
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=4", os.path.join(REPO, "pretrain_llama.py"), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    t0 = time.monotonic()
    lines = [(t0, "[launch]")]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
    if proc.returncode:
        sys.exit("bench_rollback: a run failed:\n" + "".join(x for _, x in lines[-40:]))
    return lines


def rollback_once(a) -> tuple[float, float]:
    lines = launch(job(a) + [
        "--train-iters", "10", "--reft-snapshot-every", "1", "--reft-protect", "arc,aor",
        "--reft-ranks-per-node", "1", "--reft-schedule", "end-of-iteration",
        "--reft-rollback-on", "spike", "--inject-spike", "1:10"])
    for i, (t, line) in enumerate(lines):
        m = ROLLBACK.search(line)
        if m:
            ms = float(m.group(1))
            detected = t - ms / 1000
            done = next(t2 for t2, x in lines[i + 1:] if ITER9.search(x))
            load = next(float(r.group(1)) for _, x in lines[:i] if (r := REFT_LOAD.search(x)))
            return done - detected, load / 1000
    sys.exit("bench_rollback: no rollback happened")


def persistent_once(a, ckpt: str) -> tuple[float, float]:
    lines = launch(job(a) + ["--train-iters", "9", "--load", ckpt])
    t0 = lines[0][0]
    done = next(t for t, x in lines if ITER9.search(x))
    load = next(float(m.group(1)) for _, x in lines if (m := LOAD.search(x)))
    return done - t0, load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    res = {"rollback": [], "persistent": []}
    with tempfile.TemporaryDirectory(prefix="bench-rollback-") as ckpt, \
            Progress(2 * a.repeats, desc="bench_rollback", unit="run") as bar:
        launch(job(a) + ["--train-iters", "8", "--save", ckpt])  # the state to restart from
        for _ in range(a.repeats):  # interleaved
            res["rollback"].append(rollback_once(a))
            bar.update()
            res["persistent"].append(persistent_once(a, ckpt))
            bar.update()
    med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
           for k, v in res.items()}
    print(f"model: {a.layers} layers x hidden {a.hidden}, TP1 x PP2 x DP2, ZeRO-1, "
          f"{a.repeats} interleaved repeats, medians; load only: slowest rank, clock "
          f"started after a barrier on both sides")
    print(f"{'path':<34}{'spike -> iteration 9 done':>28}{'load only':>12}")
    print(f"{'rollback in process (REFT)':<34}{med['rollback'][0]:>26.2f} s"
          f"{med['rollback'][1]:>10.3f} s")
    print(f"{'restart from persistent checkpoint':<34}{med['persistent'][0]:>26.2f} s"
          f"{med['persistent'][1]:>10.3f} s")
    print(f"persistent / rollback: {med['persistent'][0] / med['rollback'][0]:.1f}x end to "
          f"end, {med['persistent'][1] / med['rollback'][1]:.1f}x load only")
    print("raw:", {k: [(round(x, 3), round(y, 4)) for x, y in v] for k, v in res.items()})


if __name__ == "__main__":
    main()
