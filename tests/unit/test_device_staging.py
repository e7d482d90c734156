"""Device-aware save and load (reft_ext/copy/staging.py), the parts a CPU can check: the
path each tensor's device picks, the native host copy refusing device memory (meta
tensors stand in for CUDA ones: not host memory, no data), staging sizing, the
host-side routing of StreamLayout reads, the CPU fallbacks giving the reference bytes,
checksums refusing device tensors, and the GPU bubble clock's bookkeeping. The CUDA
paths themselves: tests/gpu/test_device_staging_cuda.py."""

from __future__ import annotations

import pytest
import torch

from reft_ext.copy.engine import CopyEngine
from reft_ext.copy.staging import (D2H, DEVICE, H2D, HOST, DeviceToHost, HostToDevice,
                                   Readahead,
                                   copy_path, device_bytes, host_memcpy, staging_bytes)
from reft_ext.load.fused import _copy_to_stream
from reft_ext.protect.xor import xor_encode_reference
from reft_ext.save.bubbles import GpuIdleClock, GpuStepProfile
from reft_ext.state.layout import ALIGN, StreamLayout
from reft_ext.store.checksum import CHUNK, Checksum, checksum, chunk_digest

pytestmark = pytest.mark.timeout(60)

CPU = torch.zeros(16, dtype=torch.uint8)
DEV = torch.empty(16, dtype=torch.uint8, device="meta")  # not host memory


def _stream(seed: int = 0) -> StreamLayout:
    g = torch.Generator().manual_seed(seed)
    return StreamLayout([("a", torch.randn(1001, generator=g)),
                         ("b", torch.randint(0, 1 << 15, (333,), generator=g).to(torch.bfloat16)),
                         ("c", torch.randn(70001, generator=g).double())])


def test_copy_path_follows_each_end_device():
    assert copy_path(CPU, CPU) == HOST
    assert copy_path(DEV, CPU) == H2D
    assert copy_path(CPU, DEV) == D2H
    assert copy_path(DEV, DEV) == DEVICE


@pytest.mark.parametrize("dst,src", [(DEV, CPU), (CPU, DEV), (DEV, DEV)])
def test_native_host_copy_refuses_a_device_pointer(dst, src):
    with pytest.raises(ValueError, match="native host memcpy refused"):
        host_memcpy(dst, src)


def test_host_memcpy_copies_and_checks_lengths():
    src = torch.arange(200, dtype=torch.uint8)
    dst = torch.zeros(200, dtype=torch.uint8)
    host_memcpy(dst, src)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="200 bytes into 100"):
        host_memcpy(dst[:100], src)


def test_fused_load_never_writes_host_bytes_into_a_device_tensor():
    """The REFT-load copy: a CPU destination gets the bytes; a device one without an
    H2D path is refused rather than written through its pointer."""
    s = StreamLayout([("w", torch.zeros(64, dtype=torch.float32))])
    src = torch.arange(256, dtype=torch.uint8)
    _copy_to_stream(s, 0, src)
    assert torch.equal(s.tensors[0], src)
    dev = StreamLayout([("w", torch.empty(64, dtype=torch.float32, device="meta"))])
    assert dev.on_device and not s.on_device
    with pytest.raises(ValueError, match="refused"):
        _copy_to_stream(dev, 0, src)


def test_host_to_device_takes_the_host_path_for_cpu_tensors():
    h2d = HostToDevice(step=64)
    dst = torch.zeros(300, dtype=torch.uint8)
    h2d.copy(dst, torch.arange(300, dtype=torch.uint8))
    assert torch.equal(dst, torch.arange(300, dtype=torch.uint8))
    assert h2d.devices == set()  # nothing to synchronise
    h2d.synchronize()


@pytest.mark.parametrize("n,piece,want", [(0, CHUNK, 0), (-5, CHUNK, 0), (1, CHUNK, ALIGN),
                                          (100, CHUNK, 128), (CHUNK, CHUNK, CHUNK),
                                          (10 * CHUNK, CHUNK, CHUNK), (1000, 100, 128)])
def test_staging_is_one_piece_at_most_and_aligned(n, piece, want):
    assert staging_bytes(n, piece) == want


def test_device_bytes_counts_only_device_tensors():
    ts = [torch.zeros(10), torch.empty(7, dtype=torch.float64, device="meta"),
          torch.empty(3, dtype=torch.bfloat16, device="meta")]
    assert device_bytes(ts) == 7 * 8 + 3 * 2
    assert DeviceToHost(ts[:1]).piece == 0  # all on the host: no pinned memory asked for


def test_stream_read_goes_to_the_device_reader_only_for_device_streams():
    class Reader:  # stands in for DeviceToHost, which needs CUDA for device tensors
        calls = []

        def read(self, stream, start, end, out):
            self.calls.append((start, end))
            out.fill_(7)

    host, dev = _stream(), StreamLayout([("d", torch.empty(100, device="meta"))])
    host.device_reader = dev.device_reader = Reader()
    want = torch.empty(500, dtype=torch.uint8)
    StreamLayout.read(_stream(), 100, 600, want)
    got = torch.empty(500, dtype=torch.uint8)
    host.read(100, 600, got)
    assert torch.equal(got, want) and Reader.calls == []
    out = torch.zeros(40, dtype=torch.uint8)
    dev.read(8, 48, out)
    assert Reader.calls == [(8, 48)] and bool((out == 7).all())


@pytest.mark.parametrize("start,end", [(0, 4000), (3990, 9000), (280000, 300000)])
def test_device_to_host_read_on_host_tensors_gives_stream_read_bytes(start, end):
    """Mixed streams take the host pieces natively: the same bytes as StreamLayout.read,
    padding (past the stream's end) zero-filled."""
    s, d2h = _stream(1), DeviceToHost(_stream(1).tensors)
    want = torch.full((end - start,), 9, dtype=torch.uint8)
    s.read(start, end, want)
    got = torch.full((end - start,), 9, dtype=torch.uint8)
    d2h.read(s, start, end, got)
    assert torch.equal(got, want)
    d2h.close()


def test_readahead_fills_every_unit_once_in_any_order():
    """The readahead's bookkeeping (which units are issued, each waited for once),
    whatever order the HAS thread runs units in (bubbles defer some): every unit ends
    with the stream's bytes, padding zeroed. On host tensors issue() copies at once; the
    D2H into a page-locked slot is tests/gpu/test_device_staging_cuda.py."""
    s, unit = _stream(3), 4096
    d2h = DeviceToHost(s.tensors)
    n = s.nbytes + 1000  # the last unit runs into the padding
    out = torch.full((n,), 9, dtype=torch.uint8)
    spans = [(lo, out[lo:lo + unit]) for lo in range(0, n, unit)]
    issued = []
    real_issue = d2h.issue
    d2h.issue = lambda st, a, b, o: issued.append(a) or real_issue(st, a, b, o)
    ra = Readahead(d2h, s, spans, depth=3)
    order = list(range(len(spans)))
    order[1], order[4] = order[4], order[1]
    for i in order:
        ra.fill(i)
    want = torch.empty(n, dtype=torch.uint8)
    s.read(0, n, want)
    assert torch.equal(out, want)
    assert sorted(issued) == [lo for lo, _ in spans]  # each unit issued exactly once
    assert issued[:5] == [0, 4096, 8192, 4 * 4096, 5 * 4096]  # up to 3 ahead of the unit run
    with pytest.raises(ValueError, match="depth"):
        Readahead(d2h, s, spans, depth=0)
    d2h.close()


def test_xor_read_on_host_streams_is_the_reference_parity():
    s, n = _stream(2), 5000
    starts = [0, 7000, 290000]  # the last one runs into the padding
    d2h = DeviceToHost(s.tensors)
    got = torch.empty(n, dtype=torch.uint8)
    d2h.xor_read(s, starts, got)
    parts = []
    for a in starts:
        p = torch.empty(n, dtype=torch.uint8)
        s.read(a, a + n, p)
        parts.append(p)
    want = xor_encode_reference(parts, torch.empty(n, dtype=torch.uint8))
    assert torch.equal(got, want)
    d2h.close()


def test_copy_engine_after_event_leaves_host_copies_alone():
    e = CopyEngine(1)
    src, dst = torch.arange(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    assert e.submit([(src, dst, 10, 20, 900)], after={0: object()}).wait()
    assert torch.equal(dst[20:920], src[10:910])
    e.close()


def test_checksums_refuse_device_tensors_instead_of_syncing():
    with pytest.raises(ValueError, match="only host tensors are hashed"):
        checksum(DEV)
    with pytest.raises(ValueError, match="only host tensors"):
        chunk_digest(DEV)
    with pytest.raises(ValueError, match="only host tensors"):
        Checksum().update(DEV)
    assert checksum(CPU) == checksum(bytes(16))  # host tensors as before


class _Ev:
    """A completed-or-not event at a given time (ms), for the clock's bookkeeping."""

    clock_ms = 0.0

    def __init__(self):
        self.t, self.done = None, True

    def record(self, stream=None):
        self.t = _Ev.clock_ms

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return other.t - self.t


def _phase(clock, begin_ms, end_ms):
    _Ev.clock_ms = begin_ms
    clock.compute_begin()
    _Ev.clock_ms = end_ms
    clock.compute_end()


def test_gpu_idle_clock_sums_gaps_between_compute_phases_per_step():
    made = []

    def new():
        made.append(_Ev())
        return made[-1]

    clock = GpuIdleClock(new)
    _phase(clock, 0, 10)
    _phase(clock, 14, 30)        # gap 4 ms
    _Ev.clock_ms = 35            # nested phases count once
    clock.compute_begin()
    clock.compute_begin()
    _Ev.clock_ms = 40
    clock.compute_end()
    _Ev.clock_ms = 50
    clock.compute_end()          # gap 5 ms, span 15 ms
    made[-1].done = False        # the device has not reached the last event yet
    assert clock.close_step() == []
    _phase(clock, 100, 110)      # next step: the optimizer's time (50 -> 100) is no gap
    made[-1].done = made[-3].done = True
    got = clock.close_step()
    assert [(round(i, 6), round(c, 6)) for i, c in got] == [(0.009, 0.041), (0.0, 0.010)]


def test_gpu_step_profile_uses_the_clock_not_cpu_wait_time():
    clock = GpuIdleClock(_Ev)
    prof = GpuStepProfile(clock)
    _phase(clock, 0, 10)
    _phase(clock, 30, 40)
    prof.wait_s = 123.0  # CPU time inside a p2p call: not the bubble on a GPU
    prof.close_step()
    assert prof.bubble() == pytest.approx(0.020) and prof.compute() == pytest.approx(0.020)
    assert prof.wait_s == 0.0


def test_phase_timers_drive_the_gpu_clock_on_compute_phases_only():
    from megatron.training.pipeline_events import PhaseTimers
    from reft_ext.report.timeline import PipelineEvents

    timers = PhaseTimers(PipelineEvents(0))
    timers.clock = GpuIdleClock(_Ev)
    for name, t in [("forward-compute", 0), ("forward-recv", 5), ("backward-compute", 8)]:
        _Ev.clock_ms = t
        timers(name).start()
        _Ev.clock_ms = t + 2
        timers(name).stop()
    (idle, compute), = timers.clock.close_step()
    assert idle == pytest.approx(0.006) and compute == pytest.approx(0.004)
