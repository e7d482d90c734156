"""Iteration time of the default job (tiny Llama, shipped corpus, 4 CPU ranks) per
layout, and the time from process start to the first iteration.

    python benchmarks/bench_train.py [--iters 40] [--layouts tp1pp2dp2-zero1,tp2pp2,...]

Medians over iterations after the first 5 (warm-up); these 2-core machines are noisy,
so compare layouts within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.progress import Progress  # noqa: E402  (progress with ETA on stderr)

LAYOUTS = {
    "tp1pp2dp2-zero1": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "tp2pp2dp1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp1pp1dp4": [],
    "tp2pp1dp2": ["--tensor-model-parallel-size", "2"],
    "tp1pp4dp1": ["--pipeline-model-parallel-size", "4"],
    "tp1pp2dp2-interleaved": ["--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1"],
}


def run(layout: list[str], iters: int, extra: list[str]) -> tuple[float, float, float]:
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone", "--nproc-per-node=4",
           os.path.join(REPO, "pretrain_llama.py"), "--model-size", "tiny",
           "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", str(iters),
           "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0", *layout, *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True).stdout
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    tf = [float(m) for m in re.findall(r"TFLOP/s/GPU\): ([0-9.]+)", out)]
    start = re.search(r"time from process start to first iteration: ([0-9.]+) s", out)
    if not ms or not start:
        sys.exit(out[-4000:])
    return statistics.median(ms[5:] or ms), statistics.median(tf[5:] or tf), \
        float(start.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("extra", nargs="*", help="more trainer flags, after --")
    a = ap.parse_args()
    rows = []
    names = a.layouts.split(",")
    with Progress(len(names), "bench_train", unit="run") as bar:
        for name in names:
            ms, tflops, start = run(LAYOUTS[name], a.iters, a.extra)
            rows.append((name, ms, tflops, start))
            bar.write(f"  {name}: {ms:.1f} ms/iter", file=sys.stderr)
            bar.update()
    base = rows[0][1]
    print(f"\n{'layout (4 ranks, tiny Llama, gbs 32)':40s} {'ms/iter':>9s} {'vs first':>9s} "
          f"{'TFLOP/s/rank':>13s} {'start->1st iter s':>18s}")
    for name, ms, tflops, start in rows:
        print(f"{name:40s} {ms:9.1f} {ms / base:8.2f}x {tflops:13.4f} {start:18.2f}")


if __name__ == "__main__":
    main()
