"""Copy engine: native (every ISA, 1..3 threads, streaming on/off) and reference paths copy exactly."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reft_ext import _native
from reft_ext.copy.engine import CopyEngine
from reft_ext.protect.xor import as_bytes

pytestmark = pytest.mark.timeout(120)

C = _native.C
needs_native = pytest.mark.skipif(C is None, reason=f"reft_ext._C not loaded: {_native.REASON}")


def _rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=["native", "reference"])
def engine_factory(request, monkeypatch):
    if request.param == "native" and C is None:
        pytest.skip("reft_ext._C not loaded")
    if request.param == "reference":
        monkeypatch.setattr(_native, "C", None)
    engines = []

    def make(**kw):
        e = CopyEngine(**kw)
        engines.append(e)
        assert e.native == (request.param == "native")
        return e

    yield make
    for e in engines:
        e.close()


def _items_and_expect(seed: int):
    """Sources of several dtypes copied into disjoint, unaligned ranges of one buffer."""
    g = torch.Generator().manual_seed(seed)
    srcs = [
        torch.randn(100_003, generator=g),                                   # fp32
        torch.randn(3, 777, generator=g).to(torch.bfloat16),                 # bf16, 2-D
        torch.randn(5001, generator=g).to(torch.float16),
        torch.randint(-2**31, 2**31 - 1, (4099,), dtype=torch.int32, generator=g),
        _rand_bytes((5 << 20) + 11, seed),                                   # > 4 MiB
        torch.zeros(0),
    ]
    dst = torch.zeros(sum(as_bytes(s).numel() for s in srcs) + 64 * len(srcs), dtype=torch.uint8)
    expect = dst.clone()
    items, off = [], 1
    for i, s in enumerate(srcs):
        b = as_bytes(s)
        src_off = i % 3 if b.numel() else 0  # sub-ranges starting at odd source offsets
        n = b.numel() - src_off if b.numel() else 0
        items.append((s, dst, src_off, off, n))
        expect[off:off + n] = b[src_off:src_off + n]
        off += n + 1 + i * 7
    return items, dst, expect


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nontemporal", [None, True, False])
def test_copy_matches(engine_factory, threads, nontemporal):
    eng = engine_factory(num_threads=threads, nontemporal=nontemporal, chunk_bytes=300_000)
    items, dst, expect = _items_and_expect(seed=threads)
    h = eng.submit(items)
    assert h.wait(timeout=60)
    assert h.poll() and h.done
    assert h.bytes == sum(it[4] for it in items)
    assert h.elapsed > 0
    assert torch.equal(dst, expect)


def test_many_handles_and_dropped_sources(engine_factory):
    eng = engine_factory(num_threads=2, chunk_bytes=1 << 16)
    dst = torch.zeros(64 * 100_000, dtype=torch.uint8)
    handles, expect = [], []
    for i in range(64):
        src = _rand_bytes(100_000, i)
        expect.append(src.clone())
        handles.append(eng.submit([(src, dst, 0, i * 100_000, 100_000)]))
        del src  # the handle keeps it alive until done
    for h in handles:
        assert h.wait()
    assert torch.equal(dst, torch.cat(expect))


def test_empty_and_invalid(engine_factory):
    eng = engine_factory(num_threads=1)
    a = torch.zeros(10, dtype=torch.uint8)
    h = eng.submit([])
    assert h.poll() and h.wait(0) and h.bytes == 0
    assert eng.submit([(a, a, 0, 0, 0)]).poll()
    with pytest.raises(ValueError, match="outside"):
        eng.submit([(a, torch.zeros(5, dtype=torch.uint8), 0, 0, 6)])
    with pytest.raises(ValueError, match="outside"):
        eng.submit([(a, a, -1, 0, 2)])
    with pytest.raises(ValueError, match="overlap"):
        eng.submit([(a, a, 0, 2, 4)])
    with pytest.raises(ValueError, match="contiguous"):
        eng.submit([(torch.zeros(4, 4).t(), torch.zeros(64, dtype=torch.uint8), 0, 0, 64)])


@needs_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_raw_memcpy_every_isa(isa):
    if isa != "scalar" and not C.cpu_features()[isa]:
        pytest.skip(f"CPU lacks {isa}")
    for n in (0, 1, 63, 64, 65, 4095, 16_384, 16_385, 70_001, (4 << 20) + 129):
        src = _rand_bytes(n + 7, n)
        for so, do in ((0, 0), (1, 3), (7, 0), (5, 63)):
            s = src[so:so + n]
            dst = torch.zeros(n + 64, dtype=torch.uint8)
            for nt in (0, 1):
                for threads in (1, 2):
                    dst.zero_()
                    C.memcpy(dst[do:].data_ptr(), s.data_ptr(), n, threads, isa, nt, 0)
                    assert torch.equal(dst[do:do + n], s), (n, so, do, nt, threads)
                    assert not dst[:do].any() and not dst[do + n:].any()


@needs_native
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 200_000), so=st.integers(0, 100), do=st.integers(0, 100),
       chunk=st.integers(1, 70_000), nt=st.sampled_from([-1, 0, 1]))
def test_property_native_engine(n, so, do, chunk, nt):
    src = _rand_bytes(n + so, n)
    dst = torch.zeros(n + do, dtype=torch.uint8)
    eng = C.CopyEngine(2)
    h = eng.submit([(dst.data_ptr() + do, src.data_ptr() + so, n)], chunk, nt)
    assert h.wait(30.0)
    assert h.bytes == n and h.num_chunks == (n + chunk - 1) // chunk
    assert torch.equal(dst[do:], src[so:])


@needs_native
def test_engine_refuses_use_after_fork():
    eng = C.CopyEngine(1)
    buf = bytearray(16)
    import ctypes  # noqa: PLC0415

    addr = ctypes.addressof((ctypes.c_char * 16).from_buffer(buf))
    pid = os.fork()
    if pid == 0:  # child: only C++ calls, no torch ops after fork
        try:
            eng.submit([(addr, addr + 8, 8)], 0, -1)
            os._exit(1)
        except RuntimeError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert eng.submit([(addr, addr + 8, 8)], 0, -1).wait(10.0)  # parent still fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_to_host(engine_factory):
    eng = engine_factory(num_threads=1, cuda_chunk_bytes=1 << 20)
    src = torch.randn(3_000_001, device="cuda")
    dst = torch.empty(src.numel() * 4 + 8, dtype=torch.uint8).pin_memory()
    h = eng.submit([(src, dst, 4, 3, src.numel() * 4 - 4)])
    assert h.wait()
    assert torch.equal(dst[3:3 + src.numel() * 4 - 4], as_bytes(src.cpu())[4:])
