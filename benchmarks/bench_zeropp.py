"""ZeRO++ against plain ZeRO-1 in one run (issue 35): bytes on the wire per step, time
per step, and the loss curves of both over a few hundred iterations.

    python benchmarks/bench_zeropp.py [--iters 300] [--bits 8] [--png docs/img/zeropp_loss.png]

The same bf16 job (4 layers x 64, DP4 with the distributed optimizer, 2 simulated nodes
of 2 ranks: --zero-node-size 2) runs unquantized, with --zero-quantized-weights
--zero-quantized-gradients, and with both plus --zero-hpz-partition-size 2, on loopback
gloo. Both count their bytes through the same
wrappers (REFT_ZEROPP_COUNT=1 for the unquantized run): what one rank sends per step to
ranks of its node and of other nodes, for the weight all-gather and the gradient
reduce-scatter. Bytes are the primary figure: on CPU, gloo's reduce-scatter is slower
than its all-to-all (docs/zeropp.md), so wall time flatters qgZ. Time per step: the
median of the log lines after the first ten. The final loss is the mean of the last 20;
the mock data is memorised (the loss ends near 0), so the relative loss difference is
also given over the learning phase (iterations whose unquantized loss is above 1).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "64",
         "--max-position-embeddings", "64", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
         "--lr-warmup-iters", "10", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "100000", "--use-distributed-optimizer", "--bf16",
         "--zero-node-size", "2"]
LINE = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+).*?"
                  r"lm loss: ([\d.E+-]+).*?zero\+\+ MB/step \(intra/inter\): weights "
                  r"([\d.]+)/([\d.]+), grads ([\d.]+)/([\d.]+)")


def run(iters: int, quantized: bool, bits: int, hpz: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               REFT_ZEROPP_COUNT="1")
    extra = ["--zero-quantized-weights", "--zero-quantized-gradients",
             "--zero-gradient-bits", str(bits)] if quantized else []
    extra += ["--zero-hpz-partition-size", str(hpz)] if hpz > 1 else []
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=4", os.path.join(REPO, "pretrain_llama.py"), *MODEL,
           "--train-iters", str(iters), *extra]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=3600)
    if out.returncode:
        raise RuntimeError(f"quantized={quantized} failed:\n{out.stdout[-3000:]}"
                           f"{out.stderr[-3000:]}")
    rows = [m for m in LINE.findall(out.stdout)]
    its = [int(r[0]) for r in rows]
    return {"iters": its, "ms": [float(r[1]) for r in rows],
            "loss": [float(r[2]) for r in rows],
            "bytes": [tuple(float(x) for x in r[3:]) for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--png", default="", help="draw both loss curves here")
    a = ap.parse_args()
    plain = run(a.iters, False, a.bits)
    zpp = run(a.iters, True, a.bits)
    hpz = run(a.iters, True, a.bits, hpz=2)
    print(f"\nZeRO-1 vs ZeRO++ (qwZ int8 + qgZ int{a.bits}), bf16, DP4 on 2 simulated "
          f"nodes x 2 ranks, {a.iters} iterations, loopback gloo, this 2-core host\n")
    print("| | weights MB/step intra / inter | grads MB/step intra / inter | total MB/step "
          "| inter-node MB/step | ms/step (median) | final loss (mean of last 20) |")
    print("|---|---|---|---|---|---|---|")
    totals = {}
    for name, r in (("ZeRO-1", plain), ("ZeRO++", zpp), ("ZeRO++ + hpZ 2", hpz)):
        b = r["bytes"][-1]
        totals[name] = (sum(b), b[1] + b[3])
        ms = statistics.median(r["ms"][10:])
        final = statistics.mean(r["loss"][-20:])
        r["final"] = final
        print(f"| {name} | {b[0]:.3f} / {b[1]:.3f} | {b[2]:.3f} / {b[3]:.3f} | {sum(b):.3f} "
              f"| {b[1] + b[3]:.3f} | {ms:.1f} | {final:.4f} |")
    # the learning phase (the mock data is memorised: the loss ends near 0, where a
    # relative difference says little): iterations whose unquantized loss is above 1
    rel = [abs(b - a) / a for a, b in zip(plain["loss"], zpp["loss"]) if a > 1]
    print(f"\nloss while learning (unquantized loss > 1, {len(rel)} iterations): relative "
          f"difference median {statistics.median(rel):.3%}, max {max(rel):.3%}")
    print(f"bytes on the wire: {totals['ZeRO-1'][0] / totals['ZeRO++'][0]:.2f}x fewer in "
          f"all, {totals['ZeRO-1'][1] / totals['ZeRO++'][1]:.2f}x fewer across nodes; final "
          f"loss difference {zpp['final'] - plain['final']:+.4f} "
          f"({(zpp['final'] - plain['final']) / plain['final']:+.2%})")
    rel = [abs(b - a) / a for a, b in zip(plain["loss"], hpz["loss"]) if a > 1]
    print(f"with hpZ 2: {totals['ZeRO-1'][0] / totals['ZeRO++ + hpZ 2'][0]:.2f}x fewer bytes "
          f"in all, {totals['ZeRO-1'][1] / totals['ZeRO++ + hpZ 2'][1]:.2f}x fewer across "
          f"nodes; loss while learning: median {statistics.median(rel):.3%}, max "
          f"{max(rel):.3%}; final {hpz['final']:.4f}")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(plain["iters"], plain["loss"], lw=1.2, label="ZeRO-1 (bf16 all-gather, "
                                                              "fp32 reduce-scatter)")
        ax.plot(zpp["iters"], zpp["loss"], lw=1.2, alpha=0.8,
                label=f"ZeRO++ (qwZ int8, qgZ int{a.bits})")
        ax.plot(hpz["iters"], hpz["loss"], lw=1.2, alpha=0.7, ls="--",
                label="ZeRO++ + hpZ 2 (partial distributed optimizer)")
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("DP4 ZeRO-1, bf16, 2 simulated nodes x 2 ranks", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        print(f"loss curves: {a.png}")


if __name__ == "__main__":
    main()
