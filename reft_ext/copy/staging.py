"""Device-aware byte moves between model tensors and host (shared) memory.

The native copy kernels (``reft_ext._C.memcpy``, the CPU CopyEngine) take raw pointers
and write with CPU stores: handed a CUDA pointer they crash or corrupt memory. So every
move picks its path from the devices of its two ends (:func:`copy_path`), and the native
host copy (:func:`host_memcpy`) refuses anything but CPU tensors.

* REFT-load (:class:`HostToDevice`): a device destination is filled by an H2D copy,
  ``non_blocking`` from the snapshot bytes when they are pinned, else through a small
  pinned staging ring; ``synchronize()`` before the restore reports done.
* REFT-save (:class:`DeviceToHost`): device pieces go D2H into pinned staging on a side
  stream (the CopyEngine's: native cudaMemcpyAsync where built, torch ``copy_``
  otherwise) that waits for the event ``mark()`` records after the optimizer step; the
  training stream waits on nothing. The staging is then copied into the snapshot slot,
  where the unit hashes it. With page-locked slots (``--reft-device-readahead`` > 0)
  the D2H lands in the slot itself, several units ahead of the hash (:class:`Readahead`). AEC parity of device slices is XORed on the device (the
  CUDA kernel of reft_ext/protect/xor.py) and only the parity crosses to the host.

CPU tensors take exactly the paths they took before (same bytes, same kernels).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from reft_ext import _native
from reft_ext.copy.engine import CopyEngine
from reft_ext.protect.xor import xor_encode
from reft_ext.state.layout import ALIGN, StreamLayout
from reft_ext.store.checksum import CHUNK

HOST, H2D, D2H, DEVICE = "host", "h2d", "d2h", "device"


def copy_path(dst: torch.Tensor, src: torch.Tensor) -> str:
    """Which move ``dst <- src`` is: host (native memcpy allowed), h2d, d2h or device."""
    d_host, s_host = dst.device.type == "cpu", src.device.type == "cpu"
    if d_host and s_host:
        return HOST
    return H2D if s_host else (D2H if d_host else DEVICE)


def host_memcpy(dst: torch.Tensor, src: torch.Tensor, nontemporal: int = 0) -> None:
    """dst <- src, both uint8 CPU tensors of one length: the native single-thread copy
    when built, torch's otherwise. Refuses device tensors (their pointers are not host
    memory)."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError(f"native host memcpy refused: destination on {dst.device}, source "
                         f"on {src.device}; device tensors take the H2D/D2H paths of "
                         f"reft_ext/copy/staging.py")
    if dst.numel() != src.numel():
        raise ValueError(f"host memcpy of {src.numel()} bytes into {dst.numel()}")
    C = _native.C
    if C is not None:
        C.memcpy(dst.data_ptr(), src.data_ptr(), dst.numel(), 1, "auto", nontemporal)
    else:
        dst.copy_(src)


def staging_bytes(device_bytes: int, piece: int = CHUNK) -> int:
    """Pinned staging to move ``device_bytes`` in pieces of at most ``piece``: one
    piece, no larger than the bytes to move, rounded up to ALIGN; 0 when nothing is on a
    device (no pinned memory is taken then)."""
    if device_bytes <= 0:
        return 0
    return -(-min(int(device_bytes), int(piece)) // ALIGN) * ALIGN


def device_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")


def _pinned(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class HostToDevice:
    """REFT-load into tensors that may live on a device; thread safe (each thread has its
    own staging ring). Call :meth:`synchronize` before the restore is reported done."""

    def __init__(self, step: int, slots: int = 2):
        self.step, self.slots = int(step), int(slots)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.devices: set[torch.device] = set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, nontemporal: int = 0) -> None:
        path = copy_path(dst, src)
        if path == HOST:
            host_memcpy(dst, src, nontemporal)
            return
        with self._lock:
            self.devices.add(dst.device if path != D2H else src.device)
        if path != H2D or src.is_pinned():  # async: the source (a mapping) stays alive
            dst.copy_(src, non_blocking=True)
            return
        ring = getattr(self._local, "ring", None)
        if ring is None:  # [pinned buffer, event of the copy that last read it]
            ring = self._local.ring = [[_pinned(staging_bytes(self.step, self.step)), None]
                                       for _ in range(self.slots)]
            self._local.next = 0
        for a in range(0, src.numel(), self.step):
            b = min(src.numel(), a + self.step)
            slot = ring[self._local.next]
            self._local.next = (self._local.next + 1) % self.slots
            if slot[1] is not None:
                slot[1].synchronize()  # its previous H2D has read the buffer
            buf = slot[0][:b - a]
            host_memcpy(buf, src[a:b])
            with torch.cuda.device(dst.device):
                dst[a:b].copy_(buf, non_blocking=True)
                slot[1] = torch.cuda.Event()
                slot[1].record()

    def synchronize(self) -> None:
        """Every copy issued is complete (before REFT-load says the state is restored)."""
        for dev in self.devices:
            torch.cuda.synchronize(dev)


class DeviceToHost:
    """REFT-save of device tensors: D2H on the CopyEngine's side stream after the event
    of :meth:`mark`, through a pinned staging buffer per thread (one chunk)."""

    def __init__(self, tensors: Sequence[torch.Tensor], piece: int = CHUNK,
                 engine: CopyEngine | None = None):
        self.piece = staging_bytes(device_bytes(tensors), piece)
        self.devices = sorted({t.device for t in tensors if t.device.type != "cpu"},
                              key=str)
        self.engine = engine or CopyEngine(1)
        self._local = threading.local()
        self._ready: dict[int, object] | None = None

    def mark(self) -> None:
        """Right after the optimizer step (training thread): an event on each device's
        current stream; the side stream waits for it, the training stream for nothing."""
        ready = {}
        for dev in self.devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            ready[dev.index if dev.index is not None else torch.cuda.current_device()] = ev
        self._ready = ready

    def _staging(self, n: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n:
            buf = self._local.buf = _pinned(max(n, self.piece))
        return buf[:n]

    def read(self, stream: StreamLayout, start: int, end: int, out: torch.Tensor) -> None:
        """Stream bytes [start, end) into host ``out`` (uint8), padding as zeros; same
        bytes as StreamLayout.read."""
        pieces = stream.pieces(start, end)
        dev = [p for p in pieces if stream.tensors[p.index].device.type != "cpu"]
        if dev and out.is_pinned():  # a page-locked slot takes the D2H itself
            self.complete(self.issue(stream, start, end, out, pieces))
            return
        for p in pieces:
            if stream.tensors[p.index].device.type == "cpu":
                host_memcpy(out[p.dst_off:p.dst_off + p.n],
                            stream.tensors[p.index][p.src_off:p.src_off + p.n])
        if dev:
            stage = self._staging(end - start)
            self.engine.submit([(stream.tensors[p.index], stage, p.src_off, p.dst_off, p.n)
                                for p in dev], after=self._ready).wait()
            for p in dev:
                host_memcpy(out[p.dst_off:p.dst_off + p.n], stage[p.dst_off:p.dst_off + p.n])
        covered = sum(p.n for p in pieces)
        if covered < end - start:
            out[covered:end - start].zero_()  # only the stream's tail is padding

    def issue(self, stream: StreamLayout, start: int, end: int, out: torch.Tensor,
              pieces=None):
        """Starts stream bytes [start, end) -> page-locked host ``out``: the D2H is queued
        on the side stream straight into ``out`` (no staging), host pieces and padding are
        written now. Returns what :meth:`complete` waits for."""
        pieces = stream.pieces(start, end) if pieces is None else pieces
        dev = []
        for p in pieces:
            src = stream.tensors[p.index]
            if src.device.type == "cpu":
                host_memcpy(out[p.dst_off:p.dst_off + p.n], src[p.src_off:p.src_off + p.n])
            else:
                dev.append(p)
        covered = sum(p.n for p in pieces)
        if covered < end - start:
            out[covered:end - start].zero_()  # no D2H writes there
        if not dev:
            return None
        if not out.is_pinned():
            raise ValueError("DeviceToHost.issue: the destination is not page-locked (a "
                             "D2H into pageable memory is synchronous); use read()")
        return self.engine.submit([(stream.tensors[p.index], out, p.src_off, p.dst_off, p.n)
                                   for p in dev], after=self._ready)

    @staticmethod
    def complete(pending) -> None:
        if pending is not None:
            pending.wait()

    def xor_read(self, stream: StreamLayout, starts: Sequence[int], out: torch.Tensor) -> None:
        """Host ``out`` = XOR of stream bytes [s, s + len(out)) over ``starts`` (AEC
        parity). Ranges of a stream on one device are gathered and XORed there (CUDA
        kernel where built), on the side stream after the :meth:`mark` event; only the
        parity is copied to the host. A stream not wholly on one device XORs on the host."""
        n = out.numel()
        devs = {t.device for t in stream.tensors}
        if len(devs) != 1 or next(iter(devs)).type == "cpu":
            self.read(stream, starts[0], starts[0] + n, out)
            tmp = torch.empty(n, dtype=torch.uint8)
            for s in starts[1:]:
                self.read(stream, s, s + n, tmp)
                xor_encode([tmp], out, accumulate=True)
            return
        dev = next(iter(devs))
        side = self.engine._stream_for(dev)
        training = torch.cuda.current_stream(dev)  # before the side stream is made current
        with torch.cuda.device(dev), torch.cuda.stream(side):
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            if self._ready is not None and idx in self._ready:
                side.wait_event(self._ready[idx])
            else:  # no mark(): whatever the training stream has queued so far
                side.wait_stream(training)
            acc = torch.empty(n, dtype=torch.uint8, device=dev)
            tmp = torch.empty(n, dtype=torch.uint8, device=dev)
            stream.read(starts[0], starts[0] + n, acc)
            for s in starts[1:]:
                stream.read(s, s + n, tmp)
                xor_encode([tmp], acc, accumulate=True)  # on the side (current) stream
            stage = self._staging(n)
            stage.copy_(acc, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        host_memcpy(out, stage)

    def close(self) -> None:
        self.engine.close()


class Readahead:
    """A region's device bytes copied straight into a page-locked slot, ``depth`` units
    ahead of the unit being checksummed, so the D2H of the next units overlaps the hash
    of this one (one unit at a time, the copy engine idles while the CPU hashes and the
    CPU while the copy runs: 3 GB/s on an H100, docs/gpu.md). The HAS thread runs units
    in order except those it defers to a bubble; a unit not issued yet is issued when it
    runs. Thread safe."""

    def __init__(self, stager: DeviceToHost, stream: StreamLayout,
                 spans: Sequence[tuple[int, torch.Tensor]], depth: int):
        """spans[i]: (the stream byte unit i starts at, its host destination)."""
        if depth < 1:
            raise ValueError(f"readahead depth must be >= 1, got {depth}")
        self.stager, self.stream, self.spans, self.depth = stager, stream, spans, int(depth)
        self._issued: set[int] = set()
        self._pending: dict[int, object] = {}
        self._lock = threading.Lock()

    def fill(self, i: int) -> None:
        """Unit i's bytes are in its destination on return."""
        with self._lock:
            for j in range(i, min(len(self.spans), i + self.depth)):
                if j not in self._issued:
                    self._issued.add(j)
                    lo, dst = self.spans[j]
                    self._pending[j] = self.stager.issue(self.stream, lo, lo + dst.numel(),
                                                         dst)
            pending = self._pending.pop(i)
        self.stager.complete(pending)
