"""REFT-load from own memory in one pass over the snapshot: verify and restore fused.

Restoring a region used to read it twice: a verify pass computing its checksum, then a
copy of every tensor piece into the model. Here each checksum chunk (4 MiB for the
chunked algorithms, see reft_ext/store/checksum.py) is hashed in small steps and every step is
copied to its destination tensor pieces right after it is hashed, while it is still in
cache (a device destination: an H2D copy, never a host store through its pointer, see
reft_ext/copy/staging.py; all of them complete before load_verified returns); chunks are spread over threads (xxhash / zlib and the native copy release the
GIL), so the region is read once, by every core the process may use.

The bytes land in the model BEFORE the region's checksum is known (it combines every
chunk's digest). A region whose checksum then fails has written untrusted bytes into its
destination: the caller must make sure that destination is overwritten from a trusted
source or never used (reft_ext/load/recover.py only fuses where that holds).
"""

from __future__ import annotations

import bisect
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from reft_ext import _native
from reft_ext.copy.staging import HostToDevice, host_memcpy
from reft_ext.store.checksum import CHUNK, _flat, combine
from reft_ext.state.layout import StreamLayout

STEP = 2 << 20  # hashed, then copied while still in the core's cache (size: docs/reft.md)
# regular stores, not streaming (non-temporal) ones: the restored state is what the next
# iteration reads first, and bench_load.py found regular stores faster (docs/reft.md)
NT = 0

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_native.num_cpus(), thread_name_prefix="reft-load")
    return _pool


def _copy_to_stream(stream: StreamLayout, pos: int, src: torch.Tensor,
                    h2d: HostToDevice | None = None) -> None:
    """Copy ``src`` (uint8) into stream bytes [pos, pos+len(src)); padding is skipped.
    Same bytes as StreamLayout.write, with a binary search instead of a scan (called per
    step) and the native single-thread copy when the extension is built. A destination
    not on the CPU goes through ``h2d`` (required then; the native copy refuses it)."""
    offs, end = stream.offsets, pos + src.numel()
    i = max(0, bisect.bisect_right(offs, pos) - 1)
    while i < len(offs) and offs[i] < end:
        t = stream.tensors[i]
        lo, hi = max(pos, offs[i]), min(end, offs[i] + t.numel())
        if lo < hi:
            d, s = t[lo - offs[i]:hi - offs[i]], src[lo - pos:hi - pos]
            if d.device.type == "cpu" or h2d is None:
                host_memcpy(d, s, NT)  # refuses a device destination
            else:
                h2d.copy(d, s, NT)
        i += 1


def _hash_and_copy(src: torch.Tensor, lo: int, hi: int, algorithm: str,
                   stream: StreamLayout, start: int,
                   h2d: HostToDevice | None = None) -> int:
    """Digest of src[lo:hi] (the flat algorithm), copying each step into the stream."""
    new = _flat(algorithm)
    h, crc = (new() if new is not None else None), 0
    for a in range(lo, hi, STEP):
        b = min(hi, a + STEP)
        step = src[a:b]
        if h is not None:
            h.update(step.numpy())
        else:
            crc = zlib.crc32(step.numpy(), crc)
        _copy_to_stream(stream, start + a, step, h2d)
    return h.intdigest() if h is not None else crc


def load_verified(jobs: list[tuple[torch.Tensor, int, StreamLayout, int]],
                  algorithm: str) -> list[bool]:
    """jobs: (region bytes (uint8), expected checksum, stream, stream offset). Copies
    every region into stream bytes [offset, offset + len) while checksumming it; returns,
    per job, whether the checksum matched. The copy happens whatever the verdict; copies
    into device tensors are complete on return."""
    chunked = algorithm.endswith("/4M")
    h2d = HostToDevice(STEP) if any(s.on_device for _, _, s, _ in jobs) else None
    futs = []
    for j, (src, _, stream, start) in enumerate(jobs):
        n = src.numel()
        step = CHUNK if chunked else max(n, 1)  # a flat checksum is one sequential task
        for lo in range(0, n, step):
            futs.append((j, _executor().submit(_hash_and_copy, src, lo, min(n, lo + step),
                                               algorithm, stream, start, h2d)))
    digests: list[list[int]] = [[] for _ in jobs]
    for j, f in futs:  # submitted in chunk order per job
        digests[j].append(f.result())
    if h2d is not None:
        h2d.synchronize()  # the restore is done only once the device has the bytes
    out = []
    for (src, want, _, _), d in zip(jobs, digests):
        if src.numel() == 0:
            out.append(True)  # as SnapshotStore.verify: an empty region always matches
        else:
            out.append((combine(d, algorithm) if chunked else d[0]) == want)
    return out
