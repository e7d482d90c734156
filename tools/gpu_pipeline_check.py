"""The copy-and-hash pipeline on a CUDA device (reft_ext/copy/pipeline.py, csrc/copy_hash.cpp),
the checks tools/gpu_lease.sh runs first on a lent GPU:

1. digests: ~1 GiB of random bf16 and fp32 device tensors (odd lengths, an odd tail)
   copied by the pipeline into a page-locked slot: every unit's native digest equals
   chunk_digest (python-xxhash) of the slot's bytes, and the slot equals the tensors;
2. ordering: ``torch.cuda._sleep`` on the compute stream, then ``fill_`` of the state,
   then the post-step event (what DeviceToHost.mark records): the snapshot holds the
   filled value (the side stream waited for the event, not for nothing);
3. GB/s of the pipeline at N = 1, 2, 4, 8 hashing threads, beside the D2H alone and
   the hash alone, in one table.

    python tools/gpu_pipeline_check.py [--gib 1.0] [--threads 1,2,4,8]

Exit 0 when 1 and 2 hold, 1 otherwise, 2 without CUDA or the extension's CUDA part.
tests/gpu/test_copy_hash_cuda.py runs 1 and 2 at a small size under pytest."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from reft_ext import _native  # noqa: E402
from reft_ext.copy.pipeline import RegionPipeline  # noqa: E402
from reft_ext.state.layout import StreamLayout  # noqa: E402
from reft_ext.store.checksum import CHUNK, chunk_digest  # noqa: E402


def device_state(nbytes: int, device: int = 0, seed: int = 0) -> StreamLayout:
    """Random bf16 and fp32 tensors of ~nbytes in all, lengths not multiples of a unit."""
    g = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    half = nbytes // 2
    a = torch.randn(half // 2 + 12345, generator=g, device=f"cuda:{device}").bfloat16()
    b = torch.randn((nbytes - half) // 4 - 777, generator=g, device=f"cuda:{device}")
    c = torch.randn(3, generator=g, device=f"cuda:{device}")  # a tiny last tensor
    return StreamLayout([("bf16", a), ("fp32", b), ("tail", c)])


def slot_for(stream: StreamLayout, pad: int = 4096 + 61):
    """A page-locked slot for the stream and a padded, odd tail; its 4 MiB units."""
    buf = torch.empty(stream.nbytes + pad, dtype=torch.uint8, pin_memory=True)
    buf.fill_(0xAB)  # stale bytes: the padding must come out zero
    return buf, [(lo, buf[lo:min(buf.numel(), lo + CHUNK)]) for lo in range(0, buf.numel(), CHUNK)]


def pipeline(stream: StreamLayout, spans, threads: int, event=None, device: int = 0):
    side = torch.cuda.Stream(device=device)
    if event is None:  # the state as the compute stream has it now
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    pipe = RegionPipeline(stream, spans, lambda n: threads, (device, side.cuda_stream,
                                                               event.cuda_event))
    pipe._keep = (side, event)  # alive while the pipeline is
    return pipe


def check_digests(nbytes: int, threads: int = 4) -> list[str]:
    """Problems found (empty: native digests are chunk_digest of the slot bytes)."""
    stream = device_state(nbytes)
    buf, spans = slot_for(stream)
    got = pipeline(stream, spans, threads).run(range(len(spans)))
    want = [chunk_digest(d) for _, d in spans]
    errors = [f"unit {i}: native {g:#x} != chunk_digest {w:#x}"
              for i, (g, w) in enumerate(zip(got, want)) if g != w]
    host = torch.cat([t.cpu() for t in stream.tensors])
    if not torch.equal(buf[:host.numel()], host):
        errors.append("slot bytes differ from the device tensors")
    if buf[host.numel():].any():
        errors.append("padding of the slot is not zero")
    return errors


def check_ordering(nbytes: int = 64 << 20, threads: int = 2) -> list[str]:
    """_sleep, fill_ on the compute stream, then the post-step event: the snapshot must
    hold the filled value, not the one before."""
    state = torch.zeros(nbytes // 4, device="cuda:0")
    torch.cuda.synchronize()
    stream = StreamLayout([("state", state)])
    buf, spans = slot_for(stream, pad=0)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the compute stream
    state.fill_(7.0)
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream())
    pipeline(stream, spans, threads, event=mark).run(range(len(spans)))
    vals = buf.view(torch.float32)
    if not bool((vals == 7.0).all()):
        return [f"snapshot holds {int((vals != 7.0).sum())} values from before the fill_"]
    return []


def throughput(nbytes: int, threads: list[int]) -> list[tuple[str, float]]:
    """(what, GB/s): D2H alone, hash alone (1 thread), the pipeline at each N."""
    stream = device_state(nbytes, seed=1)
    buf, spans = slot_for(stream, pad=0)
    rows = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for t in stream.tensors:
        buf[off:off + t.numel()].copy_(t, non_blocking=True)
        off += t.numel()
    torch.cuda.synchronize()
    rows.append(("D2H alone (copy_, pinned)", nbytes / (time.perf_counter() - t0) / 1e9))
    units = [(d.data_ptr(), d.numel(), d.numel(), []) for _, d in spans]
    _, st = _native.C.copy_hash(units, 1)
    rows.append(("xxh3 alone, 1 thread", nbytes / st["seconds"] / 1e9))
    for n in threads:
        pipe = pipeline(stream, spans, n)
        pipe.run(range(len(spans)))
        s = pipe.stats[-1]
        rows.append((f"pipeline N={n}", nbytes / s["seconds"] / 1e9))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes of device state, GiB")
    p.add_argument("--threads", default="1,2,4,8", help="N of the throughput rows")
    a = p.parse_args()
    if not torch.cuda.is_available() or not _native.HAVE_NATIVE_CUDA:
        print(f"gpu_pipeline_check: needs CUDA and reft_ext._C's CUDA part "
              f"(cuda available: {torch.cuda.is_available()}, native: {_native.info()})")
        return 2
    nbytes = int(a.gib * (1 << 30))
    errors = check_digests(nbytes)
    print(f"digests of {nbytes / 2**30:.2f} GiB bf16+fp32 (odd tail): "
          f"{'equal to chunk_digest' if not errors else 'MISMATCH'}")
    order = check_ordering()
    print(f"ordering (_sleep, fill_, mark): {'the snapshot holds the fill' if not order else 'WRONG'}")
    for e in (errors + order)[:10]:
        print("  " + e)
    print("| what | GB/s |\n|---|---|")
    for what, gbs in throughput(nbytes, [int(x) for x in a.threads.split(",") if x]):
        print(f"| {what} | {gbs:.1f} |")
    return 1 if errors or order else 0


if __name__ == "__main__":
    sys.exit(main())
