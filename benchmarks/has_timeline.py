"""The HAS timeline figure of docs/has.md (docs/img/has_timeline.png): a 2-rank PP2 job
(1F1B, 4 micro-batches, a core per rank) with a REFT snapshot every iteration and
--reft-trace-file, rendered by tools/plot_trace.py for two iterations.

    python benchmarks/has_timeline.py [-o docs/img/has_timeline.png] [--iterations 6:7]
                                      [--layers 4] [--hidden 512] [--seq-length 128]

What it shows depends on the machine's load (the bubbles are measured, not modelled):
run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=os.path.join(REPO, "docs/img/has_timeline.png"))
    ap.add_argument("--iterations", default="6:7", help="A:B, inclusive, of --train-iters 8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-length", type=int, default=128)
    a = ap.parse_args()
    try:
        last = int(a.iterations.split(":")[1])
    except (IndexError, ValueError):
        ap.error(f"--iterations: expected A:B, got {a.iterations!r}")
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        job = f"timeline{os.getpid()}"
        cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
               "--nproc-per-node=2", os.path.join(REPO, "pretrain_llama.py"),
               "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
               "--num-attention-heads", "8", "--seq-length", str(a.seq_length),
               "--max-position-embeddings", str(a.seq_length), "--mock-data",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
               "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
               "--global-batch-size", "4", "--train-iters", str(max(last + 1, 8)),
               "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0",
               "--reft-snapshot-every", "1", "--reft-protect", "none",
               "--reft-job-id", job, "--reft-trace-file", trace]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"has_timeline: the traced job failed:\n{proc.stdout[-4000:]}"
                     f"\n{proc.stderr[-2000:]}")
        title = (f"PP2, 1F1B, 4 micro-batches, {a.layers} layers x hidden {a.hidden}, seq "
                 f"{a.seq_length}: iterations {a.iterations.replace(':', '-')}")
        subprocess.run([sys.executable, os.path.join(REPO, "tools/plot_trace.py"), trace,
                        "-o", a.output, "--iterations", a.iterations, "--title", title],
                       check=True)


if __name__ == "__main__":
    main()
