"""AOR's device path, its CPU-side logic here (the CUDA part where CUDA is present): a
shard's spec says whether its replay is bit-identical (CPU owner) or not (GPU owner),
checksums read host bytes, a device owner's gradient goes down into a pinned buffer,
and a replica whose replay cannot match its owner bit for bit is brought back to
the owner's exact bytes by a full-shard copy (what verify's re-sync sends)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reft_ext.protect.aor import replica as R
from reft_ext.state.layout import as_bytes
from reft_ext.store.checksum import FLAT, checksum_all

CUDA = torch.cuda.is_available()


def _owner(device="cpu", foreach=None):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in (300, 7, 64)]
    opt = torch.optim.AdamW([{"params": ps[:2], "weight_decay": 0.1},
                             {"params": ps[2:], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=foreach)
    return ps, opt, R.OwnerShard([opt])


def _grads(ps, t):
    gen = torch.Generator().manual_seed(100 + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)


def _step_both(ps, opt, owner, rep, t):
    """One owner step and its replay, as the transport does (capture in a pre-hook)."""
    spec = owner.spec
    msg = R.host_buffer(spec.message_nbytes, pinned=owner.on_device)
    h = 8 * spec.header_len
    _grads(ps, t)
    owner.capture(msg[:h].view(torch.float64), msg[h:].view(torch.float32), t)
    owner.wait_capture()
    opt.step()
    rep.apply_message(msg, t)


def test_cpu_owner_spec_is_bit_identical_and_device_specs_are_not():
    _, _, owner = _owner()
    assert not owner.on_device and owner.spec.device == "cpu" and owner.spec.bit_identical
    gpu = dataclasses.replace(owner.spec, device="cuda")
    assert not gpu.bit_identical
    assert gpu.nbytes == owner.spec.nbytes  # same replica layout either way
    assert gpu != owner.spec  # a holder re-allocates when its owner moves devices


def test_checksum_reads_host_bytes_exactly_as_before():
    ts = [torch.randn(10), torch.arange(5, dtype=torch.float32)]
    assert R._checksum(ts) == checksum_all([as_bytes(t) for t in ts], FLAT)
    out = torch.empty(15)
    R._cat_into(ts, out)
    assert torch.equal(out, torch.cat(ts))


def test_device_copy_refuses_a_pageable_target():
    ps, _, owner = _owner()
    with pytest.raises(ValueError, match="pinned host buffer"):
        owner._copy_down([p.detach() for p in ps], torch.empty(371))


def test_a_replay_that_drifts_is_restored_bit_for_bit_by_the_owners_shard():
    """A replica whose replay differs (here: the owner's lr perturbed on the replica's
    side, as a GPU kernel's rounding would) no longer has the owner's checksum; the
    owner's packed shard (what verify's re-sync sends) makes it equal again, and the
    following replays match."""
    ps, opt, owner = _owner()
    buf = torch.zeros(owner.spec.nbytes, dtype=torch.uint8)
    owner.pack_state(buf)
    rep = R.AORReplica(owner.spec, buf)
    inner = rep.apply
    rep.apply = lambda lrs, wds, g: inner([lr * (1 + 2.0**-20) for lr in lrs], wds, g)
    for t in range(3):
        _step_both(ps, opt, owner, rep, t)
    assert rep.checksum() != owner.checksum()
    owner.pack_state(rep.buffer)  # the re-sync: the owner's full current shard
    assert rep.checksum() == owner.checksum()
    rep.apply = inner
    for t in range(3, 6):
        _step_both(ps, opt, owner, rep, t)
        assert rep.checksum() == owner.checksum(), t


@pytest.mark.skipif(not CUDA, reason="CUDA is not available: the device owner's D2H path")
def test_gpu_owner_grads_come_down_pinned_and_the_replay_stays_close():
    ps, opt, owner = _owner("cuda")
    assert owner.on_device and not owner.spec.bit_identical
    assert any(g.foreach for g in owner.spec.groups)  # resolved as on the owner
    buf = torch.zeros(owner.spec.nbytes, dtype=torch.uint8)
    owner.pack_state(buf)
    rep = R.AORReplica(owner.spec, buf)
    assert rep.checksum() == owner.checksum()  # host bytes of device tensors
    spec = owner.spec
    msg = R.host_buffer(spec.message_nbytes, pinned=True)
    h = 8 * spec.header_len
    _grads(ps, 0)
    owner.capture(msg[:h].view(torch.float64), msg[h:].view(torch.float32), 0)
    owner.wait_capture()
    assert torch.equal(msg[h:].view(torch.float32),
                       torch.cat([p.grad.reshape(-1) for p in ps]).cpu())
    opt.step()
    rep.apply_message(msg, 0)
    for t in range(1, 10):
        _step_both(ps, opt, owner, rep, t)
    assert rep.valid
    mine = R.host_buffer(spec.nbytes)
    owner.pack_state(mine)
    got, want = (R.region(b, spec, "param") for b in (rep.buffer, mine))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # close, not promised equal
    owner.pack_state(rep.buffer)  # re-sync
    assert rep.checksum() == owner.checksum()


def test_copy_down_tensor_by_tensor_is_the_cat_layout_bit_for_bit():
    """A device owner's grads (and its start-up pack) go down tensor by tensor, each
    straight to its offset, with no whole-shard torch.cat: the bytes are exactly the old
    layout's (torch.cat of the flattened tensors), odd lengths and shapes included; a
    buffer of another size is refused."""
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(*shape, generator=gen) for shape in ((3, 7), (1,), (5, 2, 3), (13,))]
    want = torch.cat([t.reshape(-1) for t in src])
    out = torch.full_like(want, float("nan"))
    R.copy_flat(src, out)
    assert torch.equal(as_bytes(out), as_bytes(want))
    # the owner's pack (the start-up's whole-shard message) keeps its layout too
    ps, opt, owner = _owner()
    _grads(ps, 1)
    opt.step()
    packed = torch.empty(owner.spec.nbytes, dtype=torch.uint8)
    owner.pack_state(packed)
    for name, key in (("param", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        tensors = ps if key is None else [opt.state[p][key] for p in ps]
        got = R.region(packed, owner.spec, name)
        one_by_one = torch.empty_like(got)
        R.copy_flat(tensors, one_by_one)
        assert torch.equal(as_bytes(got), as_bytes(torch.cat([t.reshape(-1) for t in tensors])))
        assert torch.equal(as_bytes(one_by_one), as_bytes(got))
    with pytest.raises(ValueError, match="elements into a buffer"):
        R.copy_flat(src, torch.empty(want.numel() + 1))
