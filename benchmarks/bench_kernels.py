"""Copy-engine and XOR-kernel throughput next to numpy/torch references, in one run.

    python benchmarks/bench_kernels.py                      # 64 MiB, 256 MiB, 1 GiB
    python benchmarks/bench_kernels.py --sizes 64M,256M --repeats 7

Every figure is GB/s (1e9 bytes) of *bytes written* (the destination of a copy,
the parity of an XOR encode), the median of --repeats timed runs after one
warm-up.  Methods are timed round-robin (one run of each method, then the next
round) so that load from other processes on a shared machine spreads over all
rows instead of hitting one.

numpy runs on one thread; torch runs with --threads intra-op threads (set here, and
named in its rows), as do the "allT" rows of the engine.

Ratios printed under the table (targets from the issue), like with like: the same
number of threads on both sides unless the row says otherwise:
  copy 1T / numpy copyto         >= 0.9   (numpy copyto is this machine's memcpy)
  copy allT / copy 1T            >  1.0   (more threads help)
  XOR k 1T / numpy xor           >= 1.5   (numpy's 2-input bitwise_xor, per output byte;
                                           one thread each)
  XOR k allT / torch xor allT             (torch's bitwise_xor on as many threads)
  XOR k nT / traffic bound nT    >= 0.8
  copy+hash nT / copy nT                  (the snapshot's copy-and-hash pipeline, 4 MiB
                                           units hashed with xxh3_64, against a copy alone;
                                           "python" is the reference path it replaces)
The traffic bound of a k-member encode is what the memory system can give it:
an encode reads k bytes and writes 1 per output byte, a copy reads 1 and writes
1, so with B_n the best copy rate measured in the same column on n threads
bound_k = B_n * 2 / (k + 1).  See docs/csrc.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reft_ext import _native  # noqa: E402
from reft_ext.copy.engine import CopyEngine  # noqa: E402
from reft_ext.copy.pipeline import RegionPipeline  # noqa: E402
from reft_ext.copy.pipeline import available as pipeline_available  # noqa: E402
from reft_ext.state.layout import StreamLayout  # noqa: E402
from reft_ext.store.checksum import CHUNK, chunk_digest  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402
from reft_ext.protect.xor import xor_encode  # noqa: E402


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def fmt_size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else f"{n >> 20} MiB"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def methods(n: int, ks: list[int], threads: int):
    """(row name, callable, bytes written) for buffers of n bytes."""
    kmax = max(ks + [2])
    # Distinct non-zero fills so every page is really backed before timing.
    srcs = [np.full(n, 17 + j, dtype=np.uint8) for j in range(kmax)]
    out = np.full(n, 3, dtype=np.uint8)
    ts = [torch.from_numpy(a) for a in srcs]
    to = torch.from_numpy(out)
    eng1, engn = CopyEngine(num_threads=1), CopyEngine(num_threads=threads)
    rows = [
        ("numpy copyto", lambda: np.copyto(out, srcs[0])),
        (f"torch copy_ {threads}T", lambda: to.copy_(ts[0])),
        ("engine copy 1T", lambda: eng1.submit([(ts[0], to, 0, 0, n)]).wait()),
        (f"engine copy {threads}T", lambda: engn.submit([(ts[0], to, 0, 0, n)]).wait()),
        ("numpy bitwise_xor", lambda: np.bitwise_xor(srcs[0], srcs[1], out=out)),
        (f"torch bitwise_xor {threads}T", lambda: torch.bitwise_xor(ts[0], ts[1], out=to)),
    ]
    # the snapshot's copy-and-hash (4 MiB units, xxh3_64): the native pipeline, one call
    # for the whole buffer, against the Python reference (a copy then chunk_digest per unit)
    stream = StreamLayout([("src", ts[0])])
    spans = [(lo, to[lo:min(n, lo + CHUNK)]) for lo in range(0, n, CHUNK)]
    if pipeline_available(False):
        pipe = RegionPipeline(stream, spans, lambda nb: 1)
        for t in sorted({1, threads}):
            rows.append((f"copy+hash pipeline {t}T",
                         lambda t=t: pipe.run(range(len(spans)), threads=t)))
    rows.append(("copy+hash python 1T", lambda: [
        (stream.read(lo, lo + d.numel(), d), chunk_digest(d)) for lo, d in spans]))
    for k in ks:
        rows.append((f"XOR encode k={k} 1T",
                     lambda k=k: xor_encode(ts[:k], to, num_threads=1)))
        rows.append((f"XOR encode k={k} {threads}T",
                     lambda k=k: xor_encode(ts[:k], to, num_threads=threads)))
    return rows, (eng1, engn)


def bench_size(n: int, ks: list[int], threads: int, repeats: int,
               bar: Progress | None = None) -> dict[str, float]:
    """``bar`` (stderr progress) advances by one per round, outside the timed calls."""
    rows, engines = methods(n, ks, threads)
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _, fn in rows:  # warm-up: page tables, thread pools, caches
        fn()
    if bar is not None:
        bar.update()
    for _ in range(repeats):
        for name, fn in rows:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if bar is not None:
            bar.update()
    for e in engines:
        e.close()
    return {name: n / statistics.median(v) / 1e9 for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,256M,1G", help="comma list, e.g. 64M,256M,1G")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ks", default="2,4,8", help="XOR member counts")
    ap.add_argument("--threads", type=int, default=0, help="'all threads' count (0: all CPUs)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    ks = [int(k) for k in args.ks.split(",") if k]
    threads = args.threads or _native.num_cpus()
    torch.set_num_threads(threads)  # torch's rows: the same thread count as "allT"

    info = _native.info()
    print(f"# {cpu_model()} | {os.cpu_count()} CPUs, {threads} used (torch "
          f"{torch.get_num_threads()} threads, numpy 1) | python "
          f"{platform.python_version()} | numpy {np.__version__} | torch {torch.__version__}")
    print(f"# native: {info.get('build', info.get('reason'))}")
    print(f"# GB/s (1e9 B/s) of bytes written, median of {args.repeats}; "
          f"loadavg at start {os.getloadavg()[0]:.2f}")
    cols: list[dict[str, float]] = []
    # one progress line (stderr) over all rounds: the warm-up and --repeats per size
    with Progress(len(sizes) * (args.repeats + 1), "bench_kernels", unit="round") as bar:
        for n in sizes:
            cols.append(bench_size(n, ks, threads, args.repeats, bar))
    names = list(cols[0])
    w = max(len(x) for x in names + [f"XOR k={max(ks)} {threads}T / torch xor {threads}T"]) + 2
    header = "method".ljust(w) + "".join(fmt_size(n).rjust(11) for n in sizes)
    print(header)
    print("-" * len(header))
    for name in names:
        print(name.ljust(w) + "".join(f"{c[name]:11.2f}" for c in cols))

    def ratio_row(label: str, fn) -> None:
        print(label.ljust(w) + "".join(f"{fn(c):11.2f}" for c in cols))

    print("-" * len(header))
    ratio_row("copy 1T / numpy copyto", lambda c: c["engine copy 1T"] / c["numpy copyto"])
    ratio_row(f"copy {threads}T / copy 1T",
              lambda c: c[f"engine copy {threads}T"] / c["engine copy 1T"])
    # the traffic bound per thread count: the best copy on as many threads
    copies = {1: ["numpy copyto", "engine copy 1T"],
              threads: [f"torch copy_ {threads}T", f"engine copy {threads}T"]}
    for t in sorted({1, threads}):  # the pipeline against a plain copy on as many threads
        if f"copy+hash pipeline {t}T" in names:
            ratio_row(f"copy+hash {t}T / copy {t}T",
                      lambda c, t=t: c[f"copy+hash pipeline {t}T"] / c[f"engine copy {t}T"])
    if "copy+hash pipeline 1T" in names:
        ratio_row("copy+hash 1T / python 1T",
                  lambda c: c["copy+hash pipeline 1T"] / c["copy+hash python 1T"])
    for k in ks:
        ratio_row(f"XOR k={k} 1T / numpy xor",
                  lambda c, k=k: c[f"XOR encode k={k} 1T"] / c["numpy bitwise_xor"])
    for k in ks:
        ratio_row(f"XOR k={k} {threads}T / torch xor {threads}T",
                  lambda c, k=k: c[f"XOR encode k={k} {threads}T"]
                  / c[f"torch bitwise_xor {threads}T"])
    for n in sorted(copies):
        for k in ks:
            ratio_row(f"XOR k={k} {n}T / bound {n}T",
                      lambda c, k=k, n=n: c[f"XOR encode k={k} {n}T"]
                      / (max(c[r] for r in copies[n]) * 2 / (k + 1)))
    print(f"# loadavg at end {os.getloadavg()[0]:.2f}; bound_k nT = best copy row on n "
          f"threads * 2/(k+1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
