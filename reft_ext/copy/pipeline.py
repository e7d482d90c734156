"""The snapshot's copy-and-hash pipeline: a region's units filled and hashed by native
threads in one call (``reft_ext._C.copy_hash``, csrc/copy_hash.cpp), the GIL released
for the whole call.

A unit is one 4 MiB chunk of a slot; its digest is ``xxh3_64`` of its bytes, exactly
:func:`reft_ext.store.checksum.chunk_digest` (the extension vendors the xxHash the
``xxhash`` package wraps). Host pieces are copied by the hashing threads; device pieces
are queued by a native issuer as ``cudaMemcpyAsync`` into the page-locked slot on the
side stream, after it waits for the post-step event (:meth:`DeviceToHost.mark`), one
event per unit, and hashed as their events complete. N, the number of hashing threads,
is the fewest that hash the bytes inside the window they have (:func:`choose_threads`).

Without the extension (or with ``REFT_DISABLE_NATIVE=1``) :attr:`RegionPipeline.native`
is False and every unit takes the reference path: its Python fill, then chunk_digest on
the calling thread (``_native`` says once why the engine is off).
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from collections.abc import Callable, Sequence

import torch

from reft_ext import _native
from reft_ext.state.layout import StreamLayout

DEFAULT_RATE = 4e9  # bytes/s one thread copies and hashes, until a call has measured it


def choose_threads(nbytes: int, window_s: float | None, rate_per_thread: float,
                   cap: int) -> int:
    """The fewest threads (1..cap) that copy and hash ``nbytes`` within ``window_s`` at
    ``rate_per_thread`` bytes/s each; ``cap`` when there is no window (0 or None: the
    caller waits for it, e.g. the drain)."""
    cap = max(1, int(cap))
    if not window_s or window_s <= 0 or rate_per_thread <= 0:
        return cap
    return max(1, min(cap, math.ceil(nbytes / (rate_per_thread * window_s))))


def unit_pieces(stream: StreamLayout, starts: Sequence[int], lens: Sequence[int]):
    """Per unit (stream bytes [starts[i], starts[i] + lens[i]), in stream order): its
    (tensor index, src_off, dst_off, n) pieces and its covered bytes (the rest is the
    stream's padded tail). One sweep over the tensors, not one scan per unit."""
    offs, out = stream.offsets, []
    for lo, n in zip(starts, lens):
        hi, pieces = lo + n, []
        i = max(0, bisect.bisect_right(offs, lo) - 1)
        while i < len(offs) and offs[i] < hi:
            t_lo, t_hi = offs[i], offs[i] + stream.tensors[i].numel()
            a, b = max(lo, t_lo), min(hi, t_hi)
            if a < b:
                pieces.append((i, a - t_lo, a - lo, b - a))
            i += 1
        out.append((pieces, sum(p[3] for p in pieces)))
    return out


class RegionPipeline:
    """One region of one snapshot: units ``spans[i] = (stream byte, host destination)``
    of ``stream``, filled and hashed by :meth:`run` (any subset, any order of calls).
    ``device``: (device index, raw side stream, raw post-step event or 0) when the
    stream has device tensors. ``threads(nbytes)`` picks N for a call."""

    def __init__(self, stream: StreamLayout, spans: Sequence[tuple[int, torch.Tensor]],
                 threads: Callable[[int], int], device: tuple[int, int, int] | None = None):
        self.stream, self.spans, self.threads = stream, list(spans), threads
        self.device = device
        self._pieces = unit_pieces(stream, [lo for lo, _ in self.spans],
                                   [d.numel() for _, d in self.spans])
        self._ptrs = [t.data_ptr() for t in stream.tensors]
        self._dev = [t.device.type != "cpu" for t in stream.tensors]
        if any(self._dev) and device is None:
            raise ValueError("RegionPipeline: device tensors need (device, stream, event)")
        self.stats: list[dict] = []  # of each native call (seconds, threads, event_wait_s)
        self._lock = threading.Lock()

    def _unit(self, i: int):
        dst = self.spans[i][1]
        pieces, covered = self._pieces[i]
        return (dst.data_ptr(), dst.numel(), covered,
                [(self._ptrs[t] + s, d, n, self._dev[t]) for t, s, d, n in pieces])

    def run(self, indices: Sequence[int], threads: int | None = None) -> list[int]:
        """Fills and hashes units ``indices``; their digests, in that order."""
        units = [self._unit(i) for i in indices]
        nbytes = sum(u[1] for u in units)
        n = int(threads or self.threads(nbytes))
        dev, stream, event = self.device or (-1, 0, 0)
        # streaming stores: each block is hashed from its source, so the slot's lines need
        # no read-for-ownership and do not evict the training's working set from the
        # caches (issue 57, benchmarks/copy_beside_compute.py: the copy ~25% faster; how
        # much less it slows compute on the next core varied between runs, docs/has.md)
        digests, stats = _native.C.copy_hash(units, n, dev, stream, event, "auto", True)
        stats["bytes"] = nbytes
        with self._lock:
            self.stats = [*self.stats[-15:], dict(stats)]
        return list(digests)

    def rate_per_thread(self) -> float | None:
        """Bytes/s per thread of the last calls (None before the first)."""
        with self._lock:
            s = [x for x in self.stats if x["seconds"] > 0 and x["bytes"] >= 1 << 20]
        if not s:
            return None
        return sum(x["bytes"] for x in s) / sum(x["seconds"] * x["threads"] for x in s)


def fixed_threads() -> int:
    """REFT_COPY_THREADS (a positive int) or 0 (chosen per call); a bad value is an error
    that names the variable."""
    raw = os.environ.get("REFT_COPY_THREADS", "").strip()
    if raw in ("", "0"):
        return 0
    if not raw.isdigit():
        from reft_ext.config import ReftConfigError  # noqa: PLC0415 - (a ValueError)

        raise ReftConfigError(f"REFT_COPY_THREADS={raw!r}: give a positive number of copy-and-hash "
                         f"threads, or 0 / unset to choose them from the bytes and the window")
    return int(raw)


# what the native threads compute: the manifest must name it (reft_ext/store/checksum.py)
ALGORITHM = "xxh3_64/4M"
_said_algorithm = False


def available(device_sources: bool) -> bool:
    """The native pipeline can serve these sources (device ones need the CUDA part), and
    the snapshot's checksum is the one it computes: without python-xxhash the default is
    crc32/4M, so the reference path serves (said once)."""
    global _said_algorithm
    if _native.C is None or not hasattr(_native.C, "copy_hash"):
        return False
    from reft_ext.store import checksum  # noqa: PLC0415

    if checksum.DEFAULT != ALGORITHM:
        if not _said_algorithm:
            _said_algorithm = True
            from reft_ext.report.events import reft_print  # noqa: PLC0415

            reft_print(f"native copy-and-hash pipeline off: the python package 'xxhash' "
                       f"is missing (pip install xxhash); snapshots are checksummed "
                       f"{checksum.DEFAULT} on the reference path",
                       event="pipeline_reference", algorithm=checksum.DEFAULT)
        return False
    return _native.HAVE_NATIVE_CUDA or not device_sources


class Pipelines:
    """The snapshotter's pipelines: one :class:`RegionPipeline` per region and snapshot,
    N per call from ``how`` (the HAS worker's: beside compute, in a bubble or at the
    drain), the per-thread rate measured by the calls so far. ``window()``: the seconds
    a snapshot has beside compute (the next forward-backward's, measured), or None.
    ``stager``: the DeviceToHost of device state (its side stream and post-step event)."""

    def __init__(self, nbytes: int, cap: int, cap_beside: int,
                 window: Callable[[], float | None], stager=None):
        self.nbytes, self.cap, self.cap_beside = int(nbytes), int(cap), int(cap_beside)
        self.window, self.stager = window, stager
        self.rate = DEFAULT_RATE
        self.fixed = fixed_threads()

    @classmethod
    def for_snapshot(cls, nbytes: int, tensors: Sequence[torch.Tensor], stager,
                     window: Callable[[], float | None]) -> "Pipelines | None":
        """The snapshotter's, or None where the extension cannot serve these tensors
        (not built, no CUDA part for device ones, several devices). The cores: this
        rank's share of the node's (LOCAL_WORLD_SIZE ranks), beside compute less the
        compute threads of CPU training."""
        device = any(t.device.type != "cpu" for t in tensors)
        if not available(device) or len({t.device for t in tensors if device and
                                          t.device.type != "cpu"}) > 1:
            return None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = _native.num_cpus()
        busy = 0 if device else local * torch.get_num_threads()
        return cls(nbytes, max(1, cpus // local), max(1, (cpus - busy) // local), window,
                   stager)

    def threads(self, how: str) -> int:
        """All this rank's share of the cores when training waits (inline, the drain);
        beside compute the fewest that finish the whole snapshot inside the window.
        REFT_COPY_THREADS=N fixes it (benchmarks: tools/gpu_lease.sh compares two N)."""
        if self.fixed:
            return self.fixed
        if how not in ("compute", "bubble"):
            return self.cap
        return choose_threads(self.nbytes, self.window(), self.rate, self.cap_beside)

    def device_args(self) -> tuple[int, int, int] | None:
        """(device, raw side stream, raw post-step event or 0) for device pieces."""
        if self.stager is None:
            return None
        dev = self.stager.devices[0]
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        side = self.stager.engine._stream_for(dev)
        ready = (self.stager._ready or {}).get(idx)
        return idx, side.cuda_stream, ready.cuda_event if ready is not None else 0

    def group(self, stream: StreamLayout | Callable[[], StreamLayout], spans,
              before: Callable[[], None]):
        """The batch call (has.Unit.batch) of one region's units; ``before()`` runs first
        (the snapshotter's fault point). ``stream``: or a function giving it, called at
        the first run (a source that is ready only then: the live AOR replica)."""
        device = self.device_args()  # (on the training thread: the rank's device)
        pipe = None if callable(stream) else RegionPipeline(stream, spans, lambda n: 1, device)

        def run(units, how: str) -> list[int]:
            nonlocal pipe
            before()
            if pipe is None:
                pipe = RegionPipeline(stream(), spans, lambda n: 1, device)
            digests = pipe.run([u.index for u in units], self.threads(how))
            self.rate = pipe.rate_per_thread() or self.rate
            return digests
        return run
