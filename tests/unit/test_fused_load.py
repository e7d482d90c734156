"""Fused REFT-load (reft_ext/load/fused.py): verify-and-copy in one pass writes exactly the
bytes of the two-pass reference (StreamLayout.write after SnapshotStore.verify's
checksum), gives the same verdict, and reports a flipped byte as a failed region."""

from __future__ import annotations

import pytest
import torch

from reft_ext import _native
from reft_ext.store.checksum import ALGORITHMS, CHUNK, checksum
from reft_ext.load.fused import load_verified
from reft_ext.state.layout import StateLayout

pytestmark = pytest.mark.timeout(60)


def _state(seed: int, zero: bool = False):
    """Tensors of mixed dtypes and sizes whose boundaries fall inside checksum chunks and
    copy steps, a zero-size one included; ~9 MiB replicated, so slices span chunks."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((1 << 20) + 3, torch.float32), (0, torch.float32), (777, torch.bfloat16),
              ((600 << 10) + 1, torch.float64), (5, torch.int64)]
    made = [torch.randint(0, 1 << 15, (n,), generator=g).to(dt) for n, dt in shapes]
    if zero:
        made = [torch.zeros_like(t) for t in made]
    owned = torch.zeros(123457, dtype=torch.float32) if zero else \
        torch.randn(123457, generator=g)
    return StateLayout([(f"t{i}", t) for i, t in enumerate(made)], [("o", owned)],
                       group_size=2, member=1)


def _snapshot(lay: StateLayout) -> list[torch.Tensor]:
    """Each slice of the replicated stream and the owned stream, as a snapshot holds them."""
    out = []
    for d in range(lay.group_size):
        buf = torch.empty(lay.slice_bytes, dtype=torch.uint8)
        lay.replicated.read(*lay.slice_range(d), buf)
        out.append(buf)
    owned = torch.empty(lay.owned.nbytes, dtype=torch.uint8)
    lay.owned.read(0, lay.owned.nbytes, owned)
    return out + [owned]


def _bytes(lay: StateLayout) -> bytes:
    return b"".join(t.numpy().tobytes() for t in lay.replicated.tensors + lay.owned.tensors)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fused_load_is_the_two_pass_restore_bit_exact(algorithm, native, monkeypatch):
    if native and _native.C is None:
        pytest.skip(f"reft_ext._C not loaded: {_native.REASON}")
    if not native:
        monkeypatch.setattr(_native, "C", None)
    src = _state(0)
    regions = _snapshot(src)
    assert regions[0].numel() > CHUNK  # several chunks and a partial tail per slice
    sums = [checksum(r, algorithm) for r in regions]
    L = src.slice_bytes
    fused, ref = _state(1, zero=True), _state(1, zero=True)
    jobs = [(regions[d], sums[d], fused.replicated, d * L) for d in range(2)] + \
        [(regions[2], sums[2], fused.owned, 0)]
    assert load_verified(jobs, algorithm) == [True, True, True]
    for d in range(2):  # the reference: verify, then write
        assert checksum(regions[d], algorithm) == sums[d]
        ref.replicated.write(d * L, regions[d])
    ref.owned.write(0, regions[2])
    assert _bytes(fused) == _bytes(ref) == _bytes(src)


def test_a_flipped_byte_fails_its_region_only():
    src = _state(2)
    regions = _snapshot(src)
    sums = [checksum(r) for r in regions]
    regions[1][CHUNK + 12345] ^= 0x01  # inside the second chunk of slice 1
    dst = _state(3, zero=True)
    L = src.slice_bytes
    jobs = [(regions[d], sums[d], dst.replicated, d * L) for d in range(2)] + \
        [(regions[2], sums[2], dst.owned, 0)]
    assert load_verified(jobs, "xxh3_64/4M") == [True, False, True]
    # the failed region's bytes did land (the caller must overwrite them): the restore
    # in reft_ext/load/recover.py rewrites every region not verified from the restored slot
    assert _bytes(dst) != _bytes(src)
    dst.replicated.write(L, _snapshot(src)[1])
    assert _bytes(dst) == _bytes(src)
