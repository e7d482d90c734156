"""AOR's verification checksum of one optimizer shard, the two functions side by side in
one run: ``xxh3`` over host bytes (reft_ext/store/checksum.py; a bit-identical CPU pair)
and ``wsum64`` (reft_ext/protect/aor/shard_layout.py; a GPU or fused owner's pair, computed
where the state lives). On a machine with CUDA also the device owner's two ways: the
state copied down (pageable ``.to("cpu")``) then xxh3, which the owner did before, against
wsum64 on the device (one scalar copied down).

    python benchmarks/bench_aor_checksum.py [--mib 256] [--repeats 5] [--threads N]

Figures: ms per shard and GB/s, medians of --repeats after one warm-up, methods timed
round-robin (a loaded machine spreads over every row); the ratio against xxh3 on host
bytes under the table. The holder's wsum64 runs on its apply thread, not the training
thread: its row is the apply thread's extra time per verification."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reft_ext.protect.aor.shard_layout import _checksum, wsum64


def _shard(mib: int, device: str) -> list[torch.Tensor]:
    """A shard's pieces as AOR orders them: params, exp_avg, exp_avg_sq (fp32, a few
    tensors each, odd sizes), the step vector."""
    n = mib * (1 << 20) // 4 // 3
    sizes = [n // 2, n // 3, n - n // 2 - n // 3]
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(s, generator=gen).to(device) for _ in range(3) for s in sizes]
    return out + [torch.full((len(sizes),), 7.0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    host = _shard(a.mib, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in host)
    methods = {"xxh3, host bytes": lambda: _checksum(host),
               f"wsum64, host ({a.threads} threads)": lambda: wsum64(host)}
    if torch.cuda.is_available():
        dev = _shard(a.mib, "cuda")

        def sync(f):
            def run():
                torch.cuda.synchronize()
                f()
                torch.cuda.synchronize()
            return run
        methods["device: .to('cpu') + xxh3 (before)"] = sync(lambda: _checksum(dev))
        methods["device: wsum64 on the device"] = sync(lambda: wsum64(dev))
        # the same value on both sides of a pair, whatever the device
        assert wsum64(host) == wsum64(dev), "wsum64 differs between CUDA and CPU"
    times = {m: [] for m in methods}
    for f in methods.values():
        f()  # warm-up
    for _ in range(a.repeats):
        for m, f in methods.items():
            t0 = time.perf_counter()
            f()
            times[m].append(time.perf_counter() - t0)
    base = statistics.median(times["xxh3, host bytes"])
    print(f"AOR checksum of a {nbytes / 2**20:.0f} MiB shard (median of {a.repeats})")
    print("| method | ms | GB/s | vs xxh3 on host bytes |\n|---|---|---|---|")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"| {m} | {1e3 * med:.1f} | {nbytes / med / 1e9:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
