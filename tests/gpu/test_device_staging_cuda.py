"""Device-aware save and load on a real GPU (reft_ext/copy/staging.py): REFT-load into
CUDA tensors (pageable and pinned snapshot bytes), REFT-save D2H on the side stream after
the post-step event, AEC parity XORed on the device, CUDA-event bubble timing. Each
result is compared bit for bit with the CPU path. Skipped without CUDA."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (the CPU-side logic is "
                                        "tests/unit/test_device_staging.py)")]

from reft_ext.copy.staging import DeviceToHost, HostToDevice, Readahead  # noqa: E402
from reft_ext.load.fused import load_verified  # noqa: E402
from reft_ext.protect.xor import xor_encode_reference  # noqa: E402
from reft_ext.save.bubbles import GpuIdleClock  # noqa: E402
from reft_ext.state.layout import StateLayout, StreamLayout  # noqa: E402
from reft_ext.store.checksum import CHUNK, checksum  # noqa: E402
from reft_ext.store.shm import ShmSegment  # noqa: E402


def _tensors(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    made = [torch.randn((1 << 20) + 3, generator=g), torch.zeros(0),
            torch.randint(0, 1 << 15, (777,), generator=g).to(torch.bfloat16),
            torch.randn((600 << 10) + 1, generator=g).double()]
    return [(f"t{i}", t.to(device)) for i, t in enumerate(made)]


def test_checksum_refuses_a_cuda_tensor():
    with pytest.raises(ValueError, match="only host tensors"):
        checksum(torch.zeros(8, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("pinned", [False, True])
def test_host_to_device_bytes(pinned):
    src = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    if pinned:
        src = src.pin_memory()
    dst = torch.zeros_like(src, device="cuda")
    h2d = HostToDevice(step=1 << 20)
    h2d.copy(dst, src)
    h2d.synchronize()
    assert torch.equal(dst.cpu(), src.cpu())


def test_fused_load_into_cuda_tensors_matches_cpu():
    cpu = StateLayout(_tensors(0, "cpu"), [], group_size=1, member=0)
    dev = StateLayout([(n, torch.zeros_like(t)) for n, t in _tensors(0, "cuda")], [],
                      group_size=1, member=0)
    data = torch.empty(cpu.padded, dtype=torch.uint8)
    cpu.replicated.read(0, cpu.padded, data)
    want = checksum(data, "xxh3_64/4M")
    assert load_verified([(data, want, dev.replicated, 0)], "xxh3_64/4M") == [True]
    for a, b in zip(cpu.replicated.tensors, dev.replicated.tensors):
        assert torch.equal(a, b.cpu())


def test_device_to_host_read_after_mark_matches_cpu_read():
    pairs = _tensors(1, "cuda")
    s = StreamLayout(pairs)
    torch.cuda.synchronize()
    d2h = DeviceToHost([t for _, t in pairs])
    pairs[0][1].add_(1.0)  # the "optimizer step", on the training stream
    d2h.mark()
    ref = StreamLayout([(n, t.cpu()) for n, t in pairs])
    for start, end in [(0, CHUNK), (CHUNK - 100, 2 * CHUNK), (s.nbytes - 50, s.nbytes + 200)]:
        want = torch.empty(end - start, dtype=torch.uint8)
        ref.read(start, end, want)
        got = torch.full((end - start,), 5, dtype=torch.uint8)
        d2h.read(s, start, end, got)
        assert torch.equal(got, want)
    d2h.close()


@pytest.mark.parametrize("depth", [1, 4])
def test_readahead_into_a_locked_segment_matches_cpu_read(depth):
    """--reft-device-readahead: D2H straight into a page-locked shared-memory slot,
    several units in flight, the units run out of order; the slot holds the state of
    the step marked (a later change on the training stream is not in it), bit for bit
    the CPU read."""
    pairs = _tensors(3, "cuda")
    s = StreamLayout(pairs)
    d2h = DeviceToHost([t for _, t in pairs])
    pairs[0][1].add_(1.0)
    d2h.mark()
    ref = StreamLayout([(n, t.cpu()) for n, t in pairs])
    n, unit = s.nbytes + 777, 1 << 20
    base = tempfile.mkdtemp(prefix="reft-test-", dir="/dev/shm")  # a slot's tmpfs
    seg = ShmSegment.create("readahead", "slot.bin", n, base_dir=base)
    assert seg.pin() and seg.tensor(torch.uint8, 0, n).is_pinned()
    out = seg.tensor(torch.uint8, 0, n)
    out.fill_(5)
    spans = [(lo, out[lo:lo + unit]) for lo in range(0, n, unit)]
    ra = Readahead(d2h, s, spans, depth)
    order = list(range(len(spans)))
    order[0], order[2] = order[2], order[0]
    for i in order:
        ra.fill(i)
    pairs[0][1].add_(1.0)  # the next step, after every unit has landed
    want = torch.empty(n, dtype=torch.uint8)
    ref.read(0, n, want)
    assert torch.equal(out, want)
    got = seg.tensor(torch.uint8, 0, n)  # read() into a locked slot takes the same path
    got.fill_(1)
    d2h.mark()
    d2h.read(s, 0, n, got)
    ref = StreamLayout([(n_, t.cpu()) for n_, t in pairs])
    ref.read(0, n, want)
    assert torch.equal(got, want)
    d2h.close()
    seg.close()
    shutil.rmtree(base, ignore_errors=True)


def test_aec_parity_on_the_device_matches_the_reference():
    pairs = _tensors(2, "cuda")
    s, ref = StreamLayout(pairs), StreamLayout([(n, t.cpu()) for n, t in pairs])
    d2h = DeviceToHost([t for _, t in pairs])
    d2h.mark()
    n, starts = 1 << 20, [0, 3 << 20, s.nbytes - 1000]
    got = torch.empty(n, dtype=torch.uint8)
    d2h.xor_read(s, starts, got)
    parts = []
    for a in starts:
        p = torch.empty(n, dtype=torch.uint8)
        ref.read(a, a + n, p)
        parts.append(p)
    assert torch.equal(got, xor_encode_reference(parts, torch.empty(n, dtype=torch.uint8)))
    d2h.close()


def test_gpu_idle_clock_sees_device_idle_not_cpu_time():
    clock = GpuIdleClock()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(2):
        clock.compute_begin()
        for _ in range(5):
            x = x @ x / 2048
        clock.compute_end()
        torch.cuda._sleep(50_000_000)  # the stream busy but no compute phase: ~tens of ms
    torch.cuda.synchronize()
    (idle, compute), = clock.close_step()
    assert idle > 0.001 and compute > 0
