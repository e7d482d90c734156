"""XOR erasure code: native kernels (every ISA path) vs the pure-torch reference, bit-exact."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reft_ext import _native
from reft_ext.protect import xor as xor_code
from reft_ext.protect.xor import as_bytes, xor_decode, xor_encode, xor_encode_reference

pytestmark = pytest.mark.timeout(120)

C = _native.C
needs_native = pytest.mark.skipif(C is None, reason=f"reft_ext._C not loaded: {_native.REASON}")


def _isas() -> list[str]:
    if C is None:
        return []
    feats = C.cpu_features()
    return ["scalar"] + [i for i in ("avx2", "avx512") if feats[i]]


def _rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _members(k: int, n: int, seed: int, offsets=None) -> list[torch.Tensor]:
    """k random byte ranges of length n, member j starting offsets[j] bytes into its buffer."""
    offsets = offsets or [0] * k
    return [_rand_bytes(n + off, seed * 100 + j)[off:off + n] for j, off in enumerate(offsets)]


def _native_raw(members, out, isa="auto", threads=1, nt=-1):
    C.xor_encode([m.data_ptr() for m in members], out.data_ptr(), out.numel(), threads, isa, nt)


def _ref(members) -> torch.Tensor:
    out = torch.empty_like(members[0])
    return xor_encode_reference(members, out)


LENGTHS = [0, 1, 2, 7, 31, 63, 64, 65, 127, 255, 256, 257, 1000, 4097, 65_537, 300_003]


@needs_native
@pytest.mark.parametrize("k", range(2, 9))
def test_every_isa_matches_reference(k):
    for n in LENGTHS:
        # unaligned sources and output, different misalignment per member
        members = _members(k, n, seed=n + k, offsets=[(3 * j + 1) % 64 for j in range(k)])
        expect = _ref(members)
        for isa in _isas():
            for nt in (0, 1):
                out = _rand_bytes(n + 5, 7)[5:]
                _native_raw(members, out, isa=isa, nt=nt)
                assert torch.equal(out, expect), (k, n, isa, nt)


@needs_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("k", [1, 9, 13])
def test_runtime_k_paths(isa, k):
    if isa not in _isas():
        pytest.skip(f"CPU lacks {isa}")
    n = 70_001
    members = _members(k, n, seed=k, offsets=[j % 7 for j in range(k)])
    out = torch.empty(n, dtype=torch.uint8)
    _native_raw(members, out, isa=isa)
    assert torch.equal(out, _ref(members))


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_multithreaded_large(threads):
    # > 4 MiB: several chunks per thread and the automatic non-temporal path.
    n = (9 << 20) + 13
    members = _members(4, n, seed=threads, offsets=[0, 1, 64, 3])
    out = torch.empty(n + 1, dtype=torch.uint8)[1:]
    _native_raw(members, out, threads=threads)
    assert torch.equal(out, _ref(members))


@needs_native
def test_bad_isa_name_rejected():
    out = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError):
        C.xor_encode([out.data_ptr()], out.data_ptr(), 8, 1, "sse9", -1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 10), n=st.integers(0, 20_000), seed=st.integers(0, 2**31 - 1),
       offs=st.lists(st.integers(0, 63), min_size=11, max_size=11))
def test_property_encode_decode(k, n, seed, offs):
    members = _members(k, n, seed, offsets=offs[:k])
    out = _rand_bytes(n + offs[10], seed)[offs[10]:]
    xor_encode(members, out)  # native when loaded, else the reference
    assert torch.equal(out, _ref(members))
    for lost in range(k):
        survivors = [m for j, m in enumerate(members) if j != lost]
        rec = torch.empty(n, dtype=torch.uint8)
        if survivors:
            xor_decode(out, survivors, rec)
        else:  # k == 1: parity is the member itself
            xor_encode([out], rec)
        assert torch.equal(rec, members[lost])


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
          torch.int32, torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_recover_bit_exact(dtype, native_on, monkeypatch):
    if native_on and C is None:
        pytest.skip("reft_ext._C not loaded")
    if not native_on:
        monkeypatch.setattr(_native, "C", None)
    k, numel = 5, 12_345
    item = torch.empty((), dtype=dtype).element_size()
    # random bit patterns reinterpreted: includes NaN payloads, -0.0, denormals
    members = [_rand_bytes(numel * item, 50 + j).view(dtype).reshape(15, -1)[:, :]
               for j in range(k)]
    parity = torch.empty_like(members[0])
    xor_encode(members, parity)
    assert torch.equal(as_bytes(parity), _ref([as_bytes(m) for m in members]))
    for lost in range(k):
        rec = torch.zeros_like(members[lost])
        xor_decode(parity, [m for j, m in enumerate(members) if j != lost], rec)
        assert torch.equal(as_bytes(rec), as_bytes(members[lost]))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "reference"])
def test_accumulate_and_aliasing(native_on, monkeypatch):
    if native_on and C is None:
        pytest.skip("reft_ext._C not loaded")
    if not native_on:
        monkeypatch.setattr(_native, "C", None)
    n = 100_003
    a, b, c = _members(3, n, seed=9)
    expect = _ref([a, b, c])
    acc = a.clone()
    xor_encode([b, c], acc, accumulate=True)
    assert torch.equal(acc, expect)
    acc = a.clone()
    xor_encode([b, acc, c], acc)  # out is a later member, exactly aliased
    assert torch.equal(acc, expect)
    buf = torch.zeros(2 * n, dtype=torch.uint8)
    with pytest.raises(ValueError, match="partially overlaps"):
        xor_encode([buf[:n], b], buf[1:n + 1])
    with pytest.raises(ValueError, match="lengths must match"):
        xor_encode([a, b[:-1]], torch.empty(n, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(torch.zeros(4, 4).t())


def test_reference_path_in_subprocess_is_bit_identical():
    """REFT_DISABLE_NATIVE=1 forces the torch path, logs once, and gives the same bytes."""
    script = textwrap.dedent("""
        import hashlib, logging, torch
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from reft_ext import _native
        from reft_ext.protect import xor as xor_code
        assert not _native.HAVE_NATIVE
        g = torch.Generator().manual_seed(1234)
        ms = [torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g) for _ in range(6)]
        out = torch.empty_like(ms[0])
        xor_code.xor_encode([m[1:] for m in ms], out[1:])
        print(hashlib.sha256(out[1:].numpy().tobytes()).hexdigest())
    """)
    env = dict(os.environ, REFT_DISABLE_NATIVE="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[REFT] native engine off (REFT_DISABLE_NATIVE is set)") == 1
    g = torch.Generator().manual_seed(1234)
    ms = [torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, generator=g) for _ in range(6)]
    out = torch.empty_like(ms[0])
    xor_code.xor_encode([m[1:] for m in ms], out[1:])  # native here when loaded
    assert r.stdout.strip() == hashlib.sha256(out[1:].numpy().tobytes()).hexdigest()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_reference():
    for n in (0, 1, 15, 16, 17, 4096 + 3, 1 << 20):
        for k in (2, 5, 8, 40):
            members = [m.cuda() for m in _members(k, n + 3, seed=n + k)]
            members = [m[j % 3:j % 3 + n] for j, m in enumerate(members)]
            out = torch.empty(n + 1, dtype=torch.uint8, device="cuda")[1:]
            xor_encode(members, out)
            assert torch.equal(out.cpu(), _ref([m.cpu() for m in members]))
