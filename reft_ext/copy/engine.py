"""Asynchronous chunked copies of tensor byte ranges into (shared-memory) host buffers.

    engine = CopyEngine(num_threads=2)
    h = engine.submit([(src, dst, src_offset, dst_offset, nbytes), ...])   # bytes
    ...                       # training goes on; the copy runs on engine threads
    if h.poll(): ...          # or h.wait(timeout=None)
    h.bytes, h.elapsed        # total bytes, seconds from submit to completion

CPU -> CPU items go to the native engine (persistent C++ threads, GIL-free,
non-temporal stores for large copies) when ``reft_ext._C`` is loaded, else to a
Python thread pool running ``Tensor.copy_`` (which releases the GIL too).
Items touching CUDA memory are enqueued as cudaMemcpyAsync on a dedicated
stream (``stream=`` picks it; default: one new stream per device), after the
stream waits on the device's current stream so the copy sees the producer's
writes; completion is an event.  Device->host is only truly asynchronous into
pinned memory (see ShmSegment.pin).

The handle keeps every tensor it reads or writes alive until it is seen done,
so callers may drop their references right after submit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch

from reft_ext import _native
from reft_ext.state.layout import as_bytes

CopyItem = tuple[torch.Tensor, torch.Tensor, int, int, int]  # src, dst, src_off, dst_off, nbytes

_REFERENCE_CHUNK = 16 << 20  # piece size for the Python-thread fallback


class CopyHandle:
    """Completion of one submit(): ``poll()``, ``wait(timeout)``, ``bytes``, ``elapsed``."""

    def __init__(self, parts: list, keepalive: list, nbytes: int, t0: float):
        self._parts = parts  # objects with poll() and wait(...)
        self._keepalive = keepalive
        self.bytes = nbytes
        self._t0 = t0
        self._t_done: float | None = None
        self._native_cpu_only = bool(parts) and all(isinstance(p, _NativeCpuPart) for p in parts)

    def poll(self) -> bool:
        if self._t_done is None:
            if not all(p.poll() for p in self._parts):
                return False
            self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks (GIL released in the native parts) until done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self._parts:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not p.wait(left):
                return False
        self._finish()
        return True

    @property
    def done(self) -> bool:
        return self.poll()

    @property
    def elapsed(self) -> float:
        """Seconds from submit to completion (to now while running)."""
        if self._native_cpu_only and len(self._parts) == 1:
            return self._parts[0].h.elapsed  # measured by the engine thread itself
        end = self._t_done if self._t_done is not None else time.perf_counter()
        return end - self._t0

    def _finish(self) -> None:
        if self._t_done is None:
            self._t_done = time.perf_counter()
            self._keepalive = []  # the sources/destinations may now be freed


class _NativeCpuPart:
    def __init__(self, h):
        self.h = h

    def poll(self) -> bool:
        return self.h.poll()

    def wait(self, timeout: float | None) -> bool:
        return self.h.wait(-1.0 if timeout is None else timeout)


class _FuturesPart:
    def __init__(self, futs: list[Future]):
        self.futs = futs

    def poll(self) -> bool:
        return all(f.done() for f in self.futs)

    def wait(self, timeout: float | None) -> bool:
        _, not_done = futures_wait(self.futs, timeout=timeout)
        for f in self.futs:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return not not_done


class _EventPart:
    """A CUDA event (native CudaEvent or torch.cuda.Event): poll, or spin-sleep to a deadline."""

    def __init__(self, ev):
        self.ev = ev

    def poll(self) -> bool:
        return self.ev.poll() if hasattr(self.ev, "poll") else self.ev.query()

    def wait(self, timeout: float | None) -> bool:
        if timeout is None:
            self.ev.wait() if hasattr(self.ev, "poll") else self.ev.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        return True


def _byte_range(t: torch.Tensor, off: int, n: int, what: str) -> torch.Tensor:
    b = as_bytes(t)
    if off < 0 or n < 0 or off + n > b.numel():
        raise ValueError(f"{what} range [{off}, {off + n}) outside its {b.numel()} bytes")
    return b[off:off + n]


class CopyEngine:
    """Chunked asynchronous copier; one per process is enough (it is thread safe)."""

    def __init__(self, num_threads: int | None = None, *, chunk_bytes: int = 0,
                 nontemporal: bool | None = None, stream=None, cuda_chunk_bytes: int = 0):
        """num_threads: CPU copy threads (default: all usable CPUs).
        chunk_bytes: CPU piece size (0: ~4 per thread, >= 256 KiB).
        nontemporal: streaming stores (None: automatic, on for >= 4 MiB submits).
        stream: torch.cuda.Stream or raw cudaStream_t int for device copies.
        cuda_chunk_bytes: split each device copy into cudaMemcpyAsync calls of this size."""
        self.num_threads = int(num_threads or _native.num_cpus())
        self.chunk_bytes = int(chunk_bytes)
        self._nt = -1 if nontemporal is None else int(bool(nontemporal))
        self._stream = stream
        self._streams: dict[int, object] = {}
        self.cuda_chunk_bytes = int(cuda_chunk_bytes)
        C = _native.C
        self._cpu = C.CopyEngine(self.num_threads) if C is not None else None
        self._pool = None if self._cpu is not None else ThreadPoolExecutor(
            self.num_threads, thread_name_prefix="reft-copy")
        self.native = self._cpu is not None
        # chosen with the engine, not read per copy: a reference engine (C off) copies
        # device bytes with torch even where the extension has a CUDA part
        self._cuda_native = C if C is not None and _native.HAVE_NATIVE_CUDA else None
        self._closed = False

    def submit(self, items: Sequence[CopyItem], after: dict | None = None) -> CopyHandle:
        """``after``: {device index: torch.cuda.Event}: device copies wait for that event
        (REFT-save: recorded after the optimizer step) instead of for everything queued
        on the device's current stream so far; None: the current stream, as before."""
        if self._closed:
            raise RuntimeError("CopyEngine is closed")
        t0 = time.perf_counter()
        cpu, gpu, keep, total = [], [], [], 0
        for src, dst, src_off, dst_off, n in items:
            s = _byte_range(src, int(src_off), int(n), "source")
            d = _byte_range(dst, int(dst_off), int(n), "destination")
            if n == 0:
                continue
            keep += [src, dst]
            total += int(n)
            if s.device.type == "cpu" and d.device.type == "cpu":
                if s.data_ptr() < d.data_ptr() + n and d.data_ptr() < s.data_ptr() + n:
                    raise ValueError("source and destination ranges overlap")
                cpu.append((s, d))
            else:
                gpu.append((s, d))
        parts = []
        if cpu:
            parts.append(self._submit_cpu(cpu))
        if gpu:
            parts += self._submit_gpu(gpu, after)
        return CopyHandle(parts, keep, total, t0)

    def _submit_cpu(self, pairs):
        if self._cpu is not None:
            h = self._cpu.submit([(d.data_ptr(), s.data_ptr(), d.numel()) for s, d in pairs],
                                 self.chunk_bytes, self._nt)
            return _NativeCpuPart(h)
        futs = []
        for s, d in pairs:
            for a in range(0, d.numel(), _REFERENCE_CHUNK):
                b = min(d.numel(), a + _REFERENCE_CHUNK)
                futs.append(self._pool.submit(d[a:b].copy_, s[a:b]))
        return _FuturesPart(futs)

    def _stream_for(self, device: torch.device):
        if self._stream is not None:
            return self._stream
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = torch.cuda.Stream(device=idx)
        return self._streams[idx]

    def _submit_gpu(self, pairs, after: dict | None = None):
        last: dict[int, object] = {}  # per stream, only the last event matters (stream order)
        for s, d in pairs:
            dev = s.device if s.device.type == "cuda" else d.device
            stream = self._stream_for(dev)
            raw = stream if isinstance(stream, int) else stream.cuda_stream
            with torch.cuda.device(dev):
                if not isinstance(stream, int):
                    idx = dev.index if dev.index is not None else torch.cuda.current_device()
                    if after is not None and idx in after:
                        stream.wait_event(after[idx])
                    else:
                        stream.wait_stream(torch.cuda.current_stream(dev))
                    for t in (s, d):  # the caching allocator must not reuse these early
                        if t.device.type == "cuda":
                            t.record_stream(stream)
                if self._cuda_native is not None:
                    last[raw] = self._cuda_native.cuda_memcpy_async(
                        d.data_ptr(), s.data_ptr(), d.numel(), self.cuda_chunk_bytes, raw)
                else:
                    ts = stream if not isinstance(stream, int) else torch.cuda.ExternalStream(raw)
                    with torch.cuda.stream(ts):
                        d.copy_(s, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(ts)
                    last[raw] = ev
        return [_EventPart(ev) for ev in last.values()]

    def close(self) -> None:
        """Finishes queued copies and stops the threads."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._cpu = None  # the C++ destructor drains its queue, then joins
