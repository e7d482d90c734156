"""REFT library pieces without processes: config validation, layout, ARC/AEC encode and
rebuild (every single lost member, D = 2..6), store commit protocol and checksums."""

import itertools
import os
import uuid

import pytest
import torch

from reft_ext.config import ReftConfig, ReftConfigError, parse_bytes
from reft_ext.state.layout import StateLayout
from reft_ext.protect.placement import check_placement
from reft_ext.protect.schemes import make_protection
from reft_ext.store.slots import SnapshotStore, from_jsonable, to_jsonable


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 13), (5,), (33, 3), (1,), (129,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.int64, torch.float16]
    return [(f"t{i}", torch.randn(s, generator=g).to(d)) for i, (s, d) in
            enumerate(zip(shapes, dtypes))]


def _layouts(D, scheme):
    state = _state()
    prot = make_protection(scheme, D)
    return state, prot, [StateLayout(state, [], D, m, prot.sub_blocks()) for m in range(D)]


@pytest.mark.parametrize("D", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("scheme", ["arc", "aec"])
def test_every_single_lost_slice_is_rebuilt(D, scheme):
    state, prot, lays = _layouts(D, scheme)
    L = lays[0].slice_bytes
    slices, red = {}, {}
    for m, lay in enumerate(lays):
        slices[m] = torch.empty(L, dtype=torch.uint8)
        lay.replicated.read(*lay.slice_range(m), slices[m])
        red[m] = torch.empty(prot.redundancy_bytes(lay), dtype=torch.uint8)
        prot.encode(lay, red[m])
    for lost in range(D):
        own_ok = [m != lost for m in range(D)]
        red_ok = [m != lost for m in range(D)]  # the lost node took its redundancy too
        plan = prot.plan(own_ok, red_ok)
        assert plan is not None and plan[lost] != "own"
        out = torch.zeros(L, dtype=torch.uint8)
        survivors = {m: t for m, t in slices.items() if m != lost}
        prot.recover(lost, survivors, red, out)
        assert torch.equal(out, slices[lost])


def test_host_bytes_match_the_paper():
    for D in (2, 4, 8):
        _, aec, lays = _layouts(D, "aec")
        L = lays[0].slice_bytes
        assert L + aec.redundancy_bytes(lays[0]) == lays[0].padded // (D - 1)
        _, arc, lays = _layouts(D, "arc")
        assert arc.redundancy_bytes(lays[0]) == lays[0].slice_bytes  # 2|P|/D in all


def test_two_lost_members_are_not_recoverable():
    for D in (3, 4):
        for a, b in itertools.combinations(range(D), 2):
            ok = [m not in (a, b) for m in range(D)]
            assert make_protection("aec", D).plan(ok, ok) is None
            if (b - a) % D in (1, D - 1):  # neighbours: the replica died with its holder
                assert make_protection("arc", D).plan(ok, ok) is None
    assert make_protection("none", 2).plan([True, False], [True, True]) is None


def test_layout_roundtrip_and_checksum():
    from reft_ext.store.checksum import checksum

    src, dst = _state(1), _state(2)
    lay = StateLayout(src, [], 3, 0, 2)
    buf = torch.empty(lay.padded, dtype=torch.uint8)
    lay.replicated.read(0, lay.padded, buf)
    assert checksum(buf) == lay.replicated.checksum(0, lay.padded)
    assert checksum(buf, "crc32") != checksum(buf)  # both algorithms exist, differ
    assert not buf[lay.replicated.nbytes:].any()  # padding reads as zeros
    StateLayout(dst, [], 3, 0, 2).replicated.write(0, buf)
    for (_, a), (_, b) in zip(src, dst):
        assert torch.equal(a, b)


def test_config_validation():
    with pytest.raises(ReftConfigError, match="--reft-protect"):
        ReftConfig(snapshot_every=1, protect="raid5")
    with pytest.raises(ReftConfigError, match="choose one"):
        ReftConfig(snapshot_every=1, protect="arc,aec")
    cfg = ReftConfig(snapshot_every=1, protect="arc", ranks_per_node=2)
    with pytest.raises(ReftConfigError, match=r"^--reft-protect arc: sharding group \(ranks "
                       r"\[0, 1\], nodes \[0, 0\]\) lives on one failure domain.*"
                       r"--use-tp-pp-dp-mapping"):
        check_placement(cfg, 4, [[0, 1], [2, 3]])
    check_placement(cfg, 4, [[0, 2], [1, 3]])
    check_placement(cfg, 8, [[0, 1, 2, 3], [4, 5, 6, 7]])  # 2 members on each of 2 nodes
    with pytest.raises(ReftConfigError, match="data-parallel size >= 2"):
        check_placement(ReftConfig(snapshot_every=1, protect="aec", ranks_per_node=1), 2,
                        [[0], [1]])
    assert parse_bytes("1.5G") == 3 << 29 and parse_bytes("512M") == 512 << 20
    with pytest.raises(ReftConfigError, match="--reft-host-memory-limit"):
        parse_bytes("lots")


def test_metadata_json_roundtrip():
    import random

    import numpy as np

    meta = {"rng": {"random": random.getstate(), "np": np.random.get_state(),
                    "torch": torch.get_rng_state()}, "steps": [3.0, None], "n": 5}
    back = from_jsonable(to_jsonable(meta))
    assert back["rng"]["random"] == meta["rng"]["random"]
    assert torch.equal(back["rng"]["torch"], meta["rng"]["torch"])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) if isinstance(a, np.ndarray)
               else a == b for a, b in zip(back["rng"]["np"], meta["rng"]["np"]))
    assert back["steps"] == [3.0, None] and back["n"] == 5


def test_store_keeps_committed_slot_and_detects_corruption():
    job = "t" + uuid.uuid4().hex[:8]
    st = SnapshotStore(job, 0, 0, "/dev/shm")
    try:
        from reft_ext.store.checksum import checksum

        slot, buf = st.begin(64)
        buf.copy_(torch.arange(64, dtype=torch.uint8))
        man = {"iteration": 1, "nbytes": 64, "checksum": "xxh3_64",
               "regions": {"own": [0, 64, checksum(buf, "xxh3_64")]}}
        st.finish(slot, man)
        st.commit(slot, 1)
        slot2, buf2 = st.begin(64)
        assert slot2 != slot  # the committed snapshot is never the one overwritten
        assert set(st.manifests()) == {slot}  # the new slot has no manifest while dirty
        assert st.verify(slot, man, "own")
        st.data(slot, 64)[10] ^= 1
        assert not st.verify(slot, man, "own")
        mode = os.stat(os.path.join(st.dir, f"rank0.slot{slot}.bin")).st_mode & 0o777
        assert mode == 0o600
    finally:
        st.remove()


def test_cli_rejects_too_little_host_memory_before_training():
    import subprocess
    import sys

    from tests.harness.run import REPO, TINY

    out = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_llama.py"), *TINY,
                          "--train-iters", "3", "--reft-snapshot-every", "1",
                          "--reft-host-memory-limit", "64K", "--reft-keep", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: --reft-host-memory-limit: snapshots need" in out.stderr
    assert "(3 slots (--reft-keep) x" in out.stderr and "lower --reft-keep" in out.stderr
    assert "iteration        1/" not in out.stdout  # nothing was trained


def test_cli_rejects_protection_without_data_parallelism():
    from megatron.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="^--reft-protect: arc needs data-parallel"):
        parse_args(["--reft-snapshot-every", "1", "--reft-protect", "arc"], world_size=1)
