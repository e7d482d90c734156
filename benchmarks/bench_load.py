"""REFT-load from own memory, in one process: GB/s of restoring a rank's snapshot slot
into its parameters / optimizer tensors, next to this machine's single-thread memcpy of
the same bytes, in the same run.

    python benchmarks/bench_load.py [--mb 512] [--repeats 5]

A StateLayout over --mb MiB of tensors (replicated stream, one member, plus a ZeRO-1
owned stream of 1/8 of it) is snapshotted into a ShmSegment as a snapshot slot lays it
out (own slice | owned state), with its region checksums (xxh3_64/4M, or crc32/4M
without xxhash). Then, round-robin (one run of each method per round, so load from other
processes on this shared machine spreads over all rows), --repeats times:

  two-pass     (torch on one thread, as in the trainer) the restore before reft_ext/load/fused.py: SnapshotStore.verify of each
               region (one checksum pass), then StreamLayout.write (a torch copy_ per
               tensor piece), as reft_ext/load/recover.py did for a rank's own memory
  fused        reft_ext/fused_load.load_verified: each 2 MiB step checksummed then copied
               to its tensor pieces while in cache, checksum chunks over every core
  memcpy 1T    numpy.copyto of the same bytes from the segment into one buffer (this
               machine's single-thread memcpy; the restore's ideal is one such read)

Figures are GB/s of restored bytes (1e9), the median of the rounds; ratios to the memcpy
of the same round (medians of the per-round ratios) are what to compare across runs.
Every restore is checked bit-exact against the source state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reft_ext import _native  # noqa: E402
from reft_ext.store.checksum import DEFAULT, checksum  # noqa: E402
from reft_ext.load.fused import load_verified  # noqa: E402
from reft_ext.state.layout import StateLayout  # noqa: E402
from reft_ext.store.shm import ShmSegment  # noqa: E402


def make_state(mb: int, seed: int) -> StateLayout:
    """Transformer-like tensors (a few large, many small) of ~mb MiB, fp32."""
    g = torch.Generator().manual_seed(seed)
    n, sizes = mb << 18, []  # fp32 elements
    while sum(sizes) < n * 7 // 8:
        sizes += [1 << 20, 3 << 18, 4096, 1024]
    rep = [(f"p{i}", torch.randn(k, generator=g)) for i, k in enumerate(sizes)]
    owned = [(f"o{i}", torch.randn(n // 16, generator=g)) for i in range(2)]
    return StateLayout(rep, owned, group_size=1, member=0)


def snapshot(lay: StateLayout, seg: ShmSegment) -> dict:
    """Regions like a slot's: own slice at 0, owned state after it, with checksums."""
    data = seg.tensor(torch.uint8, 0, seg.nbytes)
    L, n_owned = lay.slice_bytes, lay.owned.nbytes
    lay.replicated.read(0, L, data[:L])
    lay.owned.read(0, n_owned, data[L:L + n_owned])
    return {"own": (0, L, checksum(data[:L])),
            "owned": (L, n_owned, checksum(data[L:L + n_owned]))}


def state_bytes(lay: StateLayout) -> list[bytes]:
    return [t.numpy().tobytes() for t in lay.replicated.tensors + lay.owned.tensors]


def two_pass(lay, data, regions) -> None:
    for name, stream in (("own", lay.replicated), ("owned", lay.owned)):
        off, n, crc = regions[name]
        assert checksum(data[off:off + n]) == crc
        stream.write(0, data[off:off + n])


def fused(lay, data, regions) -> None:
    jobs = [(data[off:off + n], crc, stream, 0)
            for (off, n, crc), stream in ((regions["own"], lay.replicated),
                                          (regions["owned"], lay.owned))]
    assert load_verified(jobs, DEFAULT) == [True, True]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="replicated state, MiB")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as the trainer runs on CPU (megatron/training/initialize.py)
    src = make_state(a.mb, 0)
    dst = make_state(a.mb, 1)
    want = state_bytes(src)
    total = src.slice_bytes + src.owned.nbytes
    base = tempfile.mkdtemp(prefix="bench-load-", dir="/dev/shm")
    seg = ShmSegment.create("bench", "slot.bin", total, base_dir=base)
    try:
        regions = snapshot(src, seg)
        data = seg.tensor(torch.uint8, 0, total)
        flat = np.empty(total, dtype=np.uint8)
        methods = {"two-pass": lambda: two_pass(dst, data, regions),
                   "fused": lambda: fused(dst, data, regions),
                   "memcpy 1T": lambda: np.copyto(flat, data.numpy())}
        for f in methods.values():  # warm-up: destinations and the mapping touched once
            f()
        times = {k: [] for k in methods}
        for _ in range(a.repeats):
            for name, f in methods.items():
                for t in dst.replicated.tensors + dst.owned.tensors:
                    t.zero_()  # each restore writes every byte again
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
                if name != "memcpy 1T":
                    assert state_bytes(dst) == want, f"{name}: restored state differs"
        print(f"restore of {total / 1e9:.2f} GB from own memory ({a.mb} MiB replicated + "
              f"owned), checksum {DEFAULT}, native engine "
              f"{'on' if _native.HAVE_NATIVE else 'off'}, {_native.num_cpus()} CPUs, "
              f"median of {a.repeats} interleaved rounds; torch threads "
              f"{torch.get_num_threads()}")
        mc = times["memcpy 1T"]
        print(f"{'method':10s} {'GB/s':>7s} {'vs memcpy 1T':>13s}   per round (GB/s)")
        for name, ts in times.items():
            ratio = statistics.median(m / t for m, t in zip(mc, ts))
            rounds = " ".join(f"{total / t / 1e9:.2f}" for t in ts)
            print(f"{name:10s} {total / statistics.median(ts) / 1e9:7.2f} {ratio:13.2f}   "
                  f"{rounds}")
        fp = statistics.median(t / f for t, f in zip(times["two-pass"], times["fused"]))
        print(f"fused / two-pass: {fp:.2f}x (median of per-round ratios)")
    finally:
        seg.close()
        ShmSegment.remove_job("bench", base_dir=base)
        os.rmdir(base)


if __name__ == "__main__":
    main()
