"""What a snapshot copy does to compute on the next core: one process streams 115 MB of
weights through 8-token matmuls (the GPU-like regime's compute, memory-bound) while
another copies and hashes 300 MiB in 4 MiB units with the native pipeline
(``reft_ext._C.copy_hash``), with cached or streaming stores, or sleeps (docs/has.md
"CPU per part"). Pairs taking turns; the matmul pass's median and the copy's rate.

    python benchmarks/copy_beside_compute.py [--pairs 3] [--seconds 5]
        [--modes cached,streaming,streaming@3]   (KIND@R: paced to R GiB/s)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 4 << 20


def _compute(out, seconds: float, go) -> None:
    torch.set_num_threads(1)
    weights = [torch.randn(1024, 2816) for _ in range(10)]
    x = torch.randn(8, 1024)
    go.wait()
    passes, end = [], time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        for w in weights:
            x @ w
        passes.append(time.perf_counter() - t0)
    out.put(passes[2:])


def _copy(out, mode: str, seconds: float, go) -> None:
    sys.path.insert(0, REPO)
    from reft_ext import _native

    src = torch.randn(300 * 2 ** 20 // 4).view(torch.uint8)
    dst = torch.empty_like(src)
    units = [(dst.data_ptr() + o, CHUNK, CHUNK, [(src.data_ptr() + o, 0, CHUNK, False)])
             for o in range(0, src.numel(), CHUNK)]
    kind, _, cap = mode.partition("@")  # "streaming@4": at most 4 GiB/s (paced)
    gap = CHUNK / (float(cap) * 2 ** 30) if cap else 0.0
    go.wait()
    copies, busy, end = 0, 0.0, time.time() + seconds
    while time.time() < end:
        if kind == "idle":
            time.sleep(0.05)
            continue
        t0 = time.perf_counter()
        for u in units:
            t = time.perf_counter()
            _native.C.copy_hash([u], 1, -1, 0, 0, "auto", kind == "streaming")
            if gap:  # sleep out the rest of this chunk's share of time
                time.sleep(max(0.0, gap - (time.perf_counter() - t)))
        busy += time.perf_counter() - t0
        copies += 1
    out.put(copies * src.numel() / 2 ** 30 / busy if busy else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--modes", default="cached,streaming",
                    help="what copies beside the matmuls, in turns: cached, streaming, "
                         "or KIND@R (paced to at most R GiB/s)")
    a = ap.parse_args()
    for mode in a.modes.split(","):
        kind, at, cap = mode.partition("@")
        try:
            ok = kind in ("cached", "streaming") and (not at or float(cap) > 0)
        except ValueError:
            ok = False
        if not ok:
            sys.exit(f"error: --modes: {mode!r} is not cached, streaming or KIND@R with R "
                     "GiB/s > 0 (e.g. streaming@3)")
    sys.path.insert(0, REPO)
    from reft_ext import _native

    if _native.C is None or not hasattr(_native.C, "copy_hash"):
        sys.exit("the native extension is not built: python setup.py build_ext --inplace")
    print("| beside | matmul pass ms (median) | copy GiB/s | compute ms lost per 300 MiB "
          "copied |\n|---|---|---|---|")
    alone = None
    for mode in ["idle"] + a.modes.split(",") * a.pairs:
        q1, q2, go = mp.Queue(), mp.Queue(), mp.Event()
        procs = [mp.Process(target=_compute, args=(q1, a.seconds, go)),
                 mp.Process(target=_copy, args=(q2, mode, a.seconds, go))]
        for p in procs:
            p.start()
        time.sleep(2.0)  # both set up (300 MiB allocated) before either is timed
        go.set()
        passes, rate = q1.get(), q2.get()
        for p in procs:
            p.join()
        ms = 1e3 * statistics.median(passes)
        if mode == "idle":
            alone = ms
            print(f"| nothing | {ms:.2f} | - | - |")
            continue
        # the compute's slowdown while the copy runs, times how long 300 MiB take
        lost = (ms / alone - 1) * (300 / 1024 / rate) * 1e3 if rate else 0.0
        print(f"| {mode} | {ms:.2f} | {rate:.1f} | {lost:.1f} |")


if __name__ == "__main__":
    main()
