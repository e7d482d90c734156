"""The native copy-and-hash pipeline (csrc/copy_hash.cpp, reft_ext/copy/pipeline.py)
against the Python reference: the bytes StreamLayout.read writes and chunk_digest
(python-xxhash) of them, for host sources, odd tails, several threads, many regions."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from reft_ext import _native
from reft_ext.copy import pipeline
from reft_ext.copy.pipeline import RegionPipeline, choose_threads, unit_pieces
from reft_ext.save.has import Batch, HasWorker, Unit, run_units
from reft_ext.report.timeline import Trace
from reft_ext.state.layout import StreamLayout
from reft_ext.store.checksum import CHUNK, chunk_digest

native = pytest.mark.skipif(_native.C is None or not hasattr(_native.C, "copy_hash"),
                            reason=f"reft_ext._C not built: {_native.REASON}")


def _tensors(seed: int, sizes, dtypes=(torch.float32, torch.bfloat16, torch.uint8)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        t = torch.randint(0, 256, (n * torch.tensor([], dtype=dt).element_size(),),
                          dtype=torch.uint8, generator=g).view(dt)
        out.append((f"t{i}", t))
    return out


def _spans(nbytes: int, base: int = 0, pad: int = 0):
    """Units of one 4 MiB chunk over stream bytes [base, base + nbytes + pad)."""
    total = nbytes + pad
    buf = torch.full((total,), 0xAB, dtype=torch.uint8)  # stale bytes: padding must be zeroed
    return buf, [(base + lo, buf[lo:min(total, lo + CHUNK)]) for lo in range(0, total, CHUNK)]


def _reference(stream: StreamLayout, spans):
    out = []
    for lo, dst in spans:
        ref = torch.empty_like(dst)
        stream.read(lo, lo + dst.numel(), ref)
        out.append((ref, chunk_digest(ref)))
    return out


@native
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_digests_and_bytes_equal_the_reference(threads):
    # odd sizes: pieces cross unit boundaries, the last unit is a short odd tail
    stream = StreamLayout(_tensors(threads, [3 * CHUNK // 4 + 7, 1, CHUNK + 333, 12345]))
    buf, spans = _spans(stream.nbytes, pad=101)  # the stream's padded tail reads as zeros
    pipe = RegionPipeline(stream, spans, lambda n: threads)
    digests = pipe.run(range(len(spans)))
    for (ref, want), (_, dst), got in zip(_reference(stream, spans), spans, digests):
        assert torch.equal(dst, ref)
        assert got == want
    assert pipe.stats[-1]["threads"] == min(threads, len(spans))


@native
@pytest.mark.parametrize("sizes", [[1], [200, 40], [240, 1], [65536], [65535, 2],
                                   [3 * 65536 + 5, 17, 64 * 1024 * 3]])
def test_copy_fused_with_its_hash_around_the_block_edges(sizes):
    # host units are hashed block by block from their source as they are copied
    # (csrc/copy_hash.cpp copy_hash_fused): XXH3's streaming digest of 64 KiB blocks,
    # short inputs and the zeroed tail must be the one-shot digest of the written bytes
    stream = StreamLayout(_tensors(len(sizes), sizes, dtypes=(torch.uint8,)))
    for pad in (0, 3, 70000):
        buf, spans = _spans(stream.nbytes, pad=pad)
        got = RegionPipeline(stream, spans, lambda n: 1).run(range(len(spans)))
        for (ref, want), (_, dst), digest in zip(_reference(stream, spans), spans, got):
            assert torch.equal(dst, ref)
            assert digest == want == chunk_digest(dst)


@native
def test_any_subset_in_any_order_and_offset_regions():
    stream = StreamLayout(_tensors(7, [5 * CHUNK // 2 + 3, 999, 2 * CHUNK]))
    base = CHUNK + 17  # a member's slice starts inside the stream (Region.OWN)
    buf, spans = _spans(stream.nbytes - base)
    pipe = RegionPipeline(stream, spans, lambda n: 2)
    ref = _reference(stream, spans)
    order = list(range(len(spans)))[1::2] + list(range(len(spans)))[0::2][::-1]
    assert sorted(order) == list(range(len(spans)))
    got = pipe.run(order)
    assert got == [ref[i][1] for i in order]
    assert torch.equal(buf, torch.cat([r for r, _ in ref]))


@native
def test_many_regions_at_once_from_several_python_threads():
    """Several regions, each one native call, from several Python threads together (the
    GIL is released for each whole call): every digest still the reference's."""
    results, errors = {}, []

    def one(k):
        try:
            stream = StreamLayout(_tensors(100 + k, [CHUNK // 3 + k, 2 * CHUNK + 5 * k]))
            _, spans = _spans(stream.nbytes)
            got = RegionPipeline(stream, spans, lambda n: 2).run(range(len(spans)))
            results[k] = got == [d for _, d in _reference(stream, spans)]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {k: True for k in range(6)}


@native
def test_xxh3_of_every_small_length_is_pythons():
    """The short-input paths of XXH3 (0-16, 17-128, 129-240 bytes) and a long one."""
    data = torch.randint(0, 256, (CHUNK + 5,), dtype=torch.uint8)
    for n in list(range(0, 260)) + [1023, 4096 + 1, CHUNK + 5]:
        assert _native.C.xxh3_64(data.data_ptr(), n) == chunk_digest(data[:n]), n


@native
def test_bad_input_is_refused_before_any_write():
    dst = torch.zeros(16, dtype=torch.uint8)
    src = torch.ones(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="beyond its unit"):
        _native.C.copy_hash([(dst.data_ptr(), 8, 8, [(src.data_ptr(), 4, 8, False)])], 1)
    with pytest.raises(ValueError, match="zero_from"):
        _native.C.copy_hash([(dst.data_ptr(), 8, 9, [])], 1)
    assert dst.sum().item() == 0
    if not _native.HAVE_NATIVE_CUDA:  # a device piece on a build without the CUDA part
        with pytest.raises(RuntimeError, match="CUDA"):
            _native.C.copy_hash([(dst.data_ptr(), 8, 8, [(src.data_ptr(), 0, 8, True)])], 1, 0)


def test_choose_threads_from_bytes_and_window():
    assert choose_threads(10 << 30, None, 4e9, 8) == 8          # the drain: all it may use
    assert choose_threads(10 << 30, 0.0, 4e9, 8) == 8
    assert choose_threads(4 << 30, 1.5, 4e9, 8) == 1            # fits one thread's window
    assert choose_threads(19_100_000_000, 1.35, 9.3e9, 16) == 2  # docs/gpu.md's H100 case
    assert choose_threads(19_100_000_000, 0.5, 9.3e9, 16) == 5
    assert choose_threads(1 << 40, 0.1, 1e9, 3) == 3            # never above the cap


def test_unit_pieces_sweep_equals_stream_pieces():
    stream = StreamLayout(_tensors(3, [5, 100, 1, 70, 33]))
    starts = list(range(0, stream.nbytes + 40, 37))
    got = unit_pieces(stream, starts, [37] * len(starts))
    for lo, (pieces, covered) in zip(starts, got):
        want = [(p.index, p.src_off, p.dst_off, p.n) for p in stream.pieces(lo, lo + 37)]
        assert pieces == want and covered == sum(p[3] for p in want)


def test_available_needs_the_cuda_part_for_device_sources():
    assert pipeline.available(False) == (_native.C is not None)
    assert pipeline.available(True) == (_native.C is not None and _native.HAVE_NATIVE_CUDA)


def test_has_worker_runs_a_regions_units_in_groups():
    """Units sharing a batch call run several per call (all of them at the drain), and
    every unit's digest lands at its index."""
    calls = []

    def group(units, how):
        calls.append((how, [u.index for u in units]))
        return [1000 + u.index for u in units]

    units = [Unit("own", i, CHUNK, run=lambda: -1, batch=group) for i in range(10)]
    units.append(Unit("redundancy", 0, CHUNK, run=lambda: 7))
    batch = Batch(units, iteration=1)
    assert run_units(units[:3], "drain") == [1000, 1001, 1002]
    w = HasWorker(Trace(0, False))
    try:
        w._draining = True  # as drain() would: everything now
        w.submit(batch)
        w.drain()
    finally:
        w.close()
    assert batch.digests["own"] == {i: 1000 + i for i in range(10)}
    assert batch.digests["redundancy"] == {0: 7}
    assert all(len(ix) > 1 for _, ix in calls) and len(calls) < 10


def test_copy_threads_fixed_by_the_environment(monkeypatch):
    from reft_ext.copy.pipeline import Pipelines  # noqa: PLC0415

    monkeypatch.setenv("REFT_COPY_THREADS", "3")
    p = Pipelines(1 << 30, cap=8, cap_beside=2, window=lambda: 10.0)
    assert p.threads("drain") == 3 and p.threads("compute") == 3
    monkeypatch.setenv("REFT_COPY_THREADS", "0")
    p = Pipelines(1 << 30, cap=8, cap_beside=2, window=lambda: 10.0)
    assert p.threads("drain") == 8 and p.threads("compute") == 1
    monkeypatch.setenv("REFT_COPY_THREADS", "four")
    with pytest.raises(ValueError, match="REFT_COPY_THREADS='four'"):
        Pipelines(1 << 30, cap=8, cap_beside=2, window=lambda: 10.0)


@native
def test_both_hash_kernels_give_pythons_digests():
    """The AVX2 kernel (chosen at run time) and the SSE2 one (REFT_CPU_ISA=scalar) both
    give python-xxhash's digests, short and long inputs."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import os  # noqa: PLC0415

    probe = ("import torch, xxhash\nfrom reft_ext import _native\n"
             "d = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)\n"
             "ok = all(_native.C.xxh3_64(d.data_ptr(), n) == xxhash.xxh3_64(d[:n].numpy())"
             ".intdigest() for n in (0, 17, 240, 241, 1024, 99999, 3 << 20))\nprint(ok)\n")
    for isa in ("auto", "scalar"):
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, REFT_CPU_ISA=isa))
        assert r.stdout.split() == ["True"], (isa, r.stderr[-2000:])


@pytest.mark.skipif(not pipeline.available(False), reason="reft_ext._C without copy_hash")
def test_a_thread_that_cannot_start_is_raised_not_fatal():
    """copy_hash's threads under an address-space limit that leaves room for three of
    them (pthread_create: EAGAIN): the call raises naming the thread, the process lives
    (the threads it made were joined: a joinable std::thread destroyed would abort it),
    and the next call, the limit lifted, gives the same digests."""
    probe = '''
import json, resource, torch
from reft_ext import _native
C = _native.C
src = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
dst = torch.empty(16, 4096, dtype=torch.uint8)
units = [(dst[i].data_ptr(), 4096, 4096, [(src.data_ptr() + i * 4096, 0, 4096, False)])
         for i in range(16)]
ref, _ = C.copy_hash(units, 1)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm + (20 << 20), hard))
msg = ""
try:
    C.copy_hash(units, 16)
except RuntimeError as e:
    msg = str(e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
again, stats = C.copy_hash(units, 16)
print(json.dumps({"error": msg, "same": list(again) == list(ref), "threads": stats["threads"]}))
'''
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]  # (not -6: std::terminate's abort)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["error"].startswith("copy_and_hash: could not start thread "), res
    assert res["same"] and res["threads"] == 16, res
