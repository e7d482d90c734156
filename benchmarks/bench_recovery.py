"""Recovery time: host memory (own / ARC replica / AEC decode) vs the persistent
checkpoint of the same iteration on local disk, in one run, plus the end-to-end split of
a restart (kill -> first iteration).

    python benchmarks/bench_recovery.py [--layers 24 --hidden 512] [--repeats 1]

Each scenario is a real 4-rank torchrun job (TP1 x PP2 x DP2, non-distributed Adam)
that snapshots every iteration and checkpoints at iteration 2; rank 1 is SIGKILLed
when iteration 3 begins (node-loss variants also wipe its shared memory) and torchrun
restarts the job. Restore times are the slowest rank's, as printed by the trainer.
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


def run(cmd_args, max_restarts=1):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=4", f"--max-restarts={max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *cmd_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.time(), line))
    proc.wait()
    if proc.returncode != 0:
        sys.exit("".join(l for _, l in lines[-60:]))
    return lines


def _first(lines, pattern, after=0.0):
    for t, line in lines:
        if t >= after:
            m = re.search(pattern, line)
            if m:
                return t, m
    return None, None


def drop_page_cache(path):
    """Evict a checkpoint's files from the page cache (fsync + POSIX_FADV_DONTNEED, no
    root needed), so loading it really reads the disk."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def scenario(model, ckpt, protect, fault):
    """Returns (restore seconds, end-to-end split dict)."""
    args = model + ["--reft-snapshot-every", "1", "--reft-protect", protect,
                    "--reft-ranks-per-node", "1", "--save", ckpt, "--save-interval", "2",
                    "--inject-fault", fault]
    lines = run(args)
    t_kill, _ = _first(lines, r"\[FAULT\] injecting")
    ms = [float(m.group(1)) for _, l in lines
          for m in [re.search(r"\[REFT\] recovered iteration \d+ on rank \d+ from .* in "
                              r"([0-9.]+) ms", l)] if m]
    src = sorted({m.group(1) for _, l in lines
                  for m in [re.search(r"rank 1 from (.*?) \(", l)] if m})
    t_start, m = _first(lines, r"time from process start to first iteration: ([0-9.]+) s "
                               r"\((.*) s\)", after=t_kill)
    t_it, _ = _first(lines, r"iteration +3/", after=t_kill)
    split = dict(p.rsplit(" ", 1) for p in m.group(2).split(", "))
    return max(ms) / 1000.0, src, {"kill -> first iteration": t_it - t_kill,
                                   "worker start -> first iteration": float(m.group(1)),
                                   **{k: float(v) for k, v in split.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="1.3B preset's layer count")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", "8", "--seq-length", "64", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
             "--micro-batch-size", "1", "--global-batch-size", "4",
             "--pipeline-model-parallel-size", "2", "--train-iters", "3",
             "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0"]
    rows = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", REPO)) as tmp:
        for rep in range(a.repeats):
            for name, protect, fault in [("host memory, own", "arc", "1:3"),
                                         ("host memory, ARC replica", "arc", "1:3:KILL:node"),
                                         ("host memory, AEC decode", "aec", "1:3:KILL:node")]:
                ckpt = os.path.join(tmp, f"{rep}-{protect}-{len(fault)}")
                secs, src, split = scenario(model, ckpt, protect, fault)
                rows.setdefault(name, []).append((secs, split, src))
            # the persistent checkpoint of the same iteration (2), loaded on restart (the
            # job also wrote a final one at 3: point the tracker back at 2)
            with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2")
            for name, cold in [("persistent checkpoint, page cache", False),
                               ("persistent checkpoint, local disk", True)]:
                if cold:
                    drop_page_cache(os.path.join(ckpt, "iter_0000002"))
                lines = run(model + ["--load", ckpt, "--train-iters", "3"], max_restarts=0)
                _, m = _first(lines, r"loaded checkpoint .* at iteration 2 \[([0-9.]+) s\]")
                rows.setdefault(name, []).append((float(m.group(1)), None, None))
    state_mb = a.layers * 12 * a.hidden ** 2 * 4 * 3 / 2 ** 20
    print(f"\nrestore of the training state (~{state_mb:.0f} MiB params+Adam, TP1xPP2xDP2, "
          f"4 ranks; median of {a.repeats}; slowest rank)")
    disk = statistics.median(s for s, _, _ in rows["persistent checkpoint, local disk"])
    print(f"{'source':36s} {'seconds':>9s} {'speed-up vs local disk':>23s}")
    for name, vals in rows.items():
        sec = statistics.median(s for s, _, _ in vals)
        print(f"{name:36s} {sec:9.3f} {disk / sec:22.1f}x")
    print("\nend-to-end recovery (kill -> first iteration after restart), seconds:")
    for name, vals in rows.items():
        if vals[0][1] is None:
            continue
        split = vals[len(vals) // 2][1]
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
