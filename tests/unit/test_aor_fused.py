"""AOR and the optimizer table for what megatron-core builds with TransformerEngine or
apex (FusedAdam, FusedSGD), and the device checksum of a replay that is not bit-identical.
apex/TE cannot be installed here: tests/harness/fused_standins.py stands in for them with
apex's documented state layout (moments in ``state``, the step in each group,
``capturable`` on the optimizer). Two real gloo ranks run the transport's
verify-and-resync with a FusedAdam owner: the replica is exact at every verification,
whatever the snapshot interval, and its checksum comes from the apply thread."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.training import optimizer_state as ost
from reft_ext.protect.aor import replica as R
from reft_ext.protect.aor import shard_layout as SL
from tests.harness.fused_standins import FusedAdam, FusedSGD


def _params(seed=0, sizes=(300, 7, 64)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(ps, t):
    gen = torch.Generator().manual_seed(100 + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)


# ---- the table: capturable where each optimizer keeps it, FusedSGD captured ----------
def test_capturable_is_read_on_the_fused_optimizer_not_its_groups():
    opt = FusedAdam(_params(), lr=1e-3, capturable=True)
    assert "capturable" not in opt.param_groups[0]  # apex keeps it on the optimizer
    with pytest.raises(ost.UnsupportedOptimizer, match="capturable=True"):
        ost.kind_of(opt)
    with pytest.raises(NotImplementedError, match="capturable=True"):
        R.OwnerShard([opt])
    plain = FusedAdam(_params(), lr=1e-3)
    assert ost.kind_of(plain).name == "apex/TransformerEngine FusedAdam"
    # torch keeps it in the group: a capturable torch Adam is captured (step on device)
    assert ost.capturable(torch.optim.Adam(_params(), capturable=False),
                          {"capturable": True})


def test_fused_sgd_momentum_is_listed_before_step_1_and_step_1_is_bit_identical():
    lazy_p, eager_p = _params(), _params()
    lazy, eager = FusedSGD(lazy_p, lr=0.1, momentum=0.9), FusedSGD(eager_p, lr=0.1,
                                                                    momentum=0.9)
    wrapped = type("W", (), {"optimizer": eager})()
    assert ost.kind_of(eager).name == "apex/TransformerEngine FusedSGD"
    ost.ensure_state(wrapped)
    listed = [st[k] for _, st, ks in ost.captured_states(wrapped) for k in ks]
    assert len(listed) == len(eager_p)
    check = ost.FirstStepCheck(wrapped, listed)
    for t in (1, 2, 3):
        _grads(lazy_p, t)
        _grads(eager_p, t)
        lazy.step()
        eager.step()  # the first step takes the later formula on the -0.0 buffer
    check.remove()
    for a, b in zip(lazy_p, eager_p):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ost.UnsupportedOptimizer, match="dampening"):
        ost.kind_of(FusedSGD(_params(), momentum=0.9, dampening=0.1))


def test_megatron_cores_choice_per_source_is_in_the_table_with_its_aor_column():
    for (source, optimizer), name in ost.BUILT_BY.items():
        kind = ost.kind_named(name)
        assert (kind.aor is not None) == (optimizer == "adam"), (source, optimizer)


# ---- the checksum a device computes ----------------------------------------------------
def test_wsum64_sees_one_flipped_bit_and_moved_words_and_not_the_chunking():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3 * R.WSUM_CHUNK // 2 + 5, generator=gen)
    b = torch.randn(17, generator=gen)
    base = R.wsum64([a, b])
    assert base == R.wsum64([torch.cat([a, b])]) == R.wsum64([a[:1000], a[1000:], b])
    flipped = a.clone()
    flipped.view(torch.int32)[R.WSUM_CHUNK + 3] ^= 1 << 31  # the sign bit
    swapped = a.clone()
    swapped[[10, 2 * R.WSUM_CHUNK // 3]] = a[[2 * R.WSUM_CHUNK // 3, 10]]
    assert len({base, R.wsum64([flipped, b]), R.wsum64([swapped, b]),
                R.wsum64([b, a])}) == 4
    assert 0 <= base < 2 ** 64


def test_fused_owner_spec_is_not_bit_identical_and_round_trips_its_group_steps():
    ps = _params()
    opt = FusedAdam([{"params": ps[:2], "weight_decay": 0.1},
                     {"params": ps[2:], "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    owner = R.OwnerShard([opt])
    assert owner.kind == "fused_adam" and owner.spec.kind == "fused_adam"
    assert not owner.spec.bit_identical and owner.step_count() == 0.0
    assert all(g.decoupled_weight_decay for g in owner.spec.groups)  # adam_w_mode
    for t in (1, 2):
        _grads(ps, t)
        opt.step()
    packed = torch.empty(owner.spec.nbytes, dtype=torch.uint8)
    owner.pack_state(packed)
    rep = R.AORReplica(owner.spec, packed.clone())
    assert rep.checksum() == owner.checksum() and rep.step_count() == 2.0
    for g in opt.param_groups:
        g["step"] = 9
    owner.unpack_state(packed)
    assert [g["step"] for g in opt.param_groups] == [2, 2]


# ---- verify and re-sync across two gloo ranks ------------------------------------------
def _pair(rank: int, store_path: str, out: str, every: int, steps: int) -> None:
    from reft_ext.protect.aor.transport import AORTransport

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)
    try:
        ps = _params(seed=rank)
        opt = FusedAdam(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        aor = AORTransport([opt], dist.new_group([0, 1], backend="gloo"))
        aor.verify_every = every
        aor.initialize()
        rows = []
        for t in range(1, steps + 1):
            _grads(ps, 10 * t + rank)
            opt.step()
            aor.wait()
            early = dict(aor._early_sums)
            row = {"step": t, "exact_before": aor.exact(), "early": sorted(early)}
            if t % every == 0:
                r = aor.verify(t)
                row.update(match=r["match"], resynced=r["resynced"])
                aor.wait()
                mine = torch.empty(aor.owner.spec.nbytes, dtype=torch.uint8)
                aor.owner.pack_state(mine)
                theirs = torch.empty_like(aor.replica.buffer)
                works = [dist.irecv(theirs, src=aor.owner_rank, group=aor.group, tag=9),
                         dist.isend(mine, dst=aor.holder_rank, group=aor.group, tag=9)]
                for w in works:
                    w.wait()
                row.update(equal=torch.equal(theirs, aor.replica.buffer),
                           exact_after=aor.exact())
            rows.append(row)
        aor.close()
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def test_fused_adam_replica_is_exact_at_every_verification_and_checksummed_early(tmp_path):
    out, every = str(tmp_path / "rows"), 3
    mp.spawn(_pair, args=(str(tmp_path / "store"), out, every, 7), nprocs=2, join=True)
    for rank in (0, 1):
        rows = json.load(open(f"{out}.{rank}"))
        verified = [r for r in rows if r["step"] % every == 0]
        assert [r["step"] for r in verified] == [3, 6]
        for r in verified:
            assert r["early"] == [r["step"]]  # the apply thread took the checksum
            assert r["equal"] and r["exact_after"]  # the owner's bytes, after any re-sync
            assert r["resynced"] == (not r["match"])
        # between verifications no early checksum is taken
        assert all(r["early"] == [] for r in rows if r["step"] % every)
    assert os.path.exists(f"{out}.0")


def test_wsum64_in_blocks_equals_its_chunk_by_chunk_definition():
    """wsum64 (whole chunks as a reshaped view, WSUM_BLOCK at a time) is bit-exact with
    wsum64_reference: pieces with heads and tails off the chunk boundaries, more whole
    chunks than a block, a piece of exactly one chunk, large words that wrap int64."""
    gen = torch.Generator().manual_seed(5)
    C = R.WSUM_CHUNK
    words = lambda n: torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32,  # noqa: E731
                                    generator=gen)
    cases = [[words(3)], [words(C)], [words(C + 7), words(C - 7)],
             [words(C // 3), words((SL.WSUM_BLOCK + 2) * C + 11), words(5)],
             [torch.full((2 * C,), 2**31 - 1, dtype=torch.int32)],
             [words(C).view(torch.float32), words(17)]]
    for pieces in cases:
        assert R.wsum64(pieces) == SL.wsum64_reference(pieces), [p.numel() for p in pieces]
    one = words(2 * C + 3)
    assert R.wsum64([one]) == R.wsum64([one[:C + 1], one[C + 1:]])
