"""State that cannot prove it is whole and this run's is not used: a manifest or commit
pointer without its seal, a flushed slot without the commit pointer that names it, a
manifest without a run identity. Real files on /dev/shm and in a flush directory."""

import json
import os
import shutil
import uuid

import pytest
import torch.distributed as dist


from reft_ext.load.flushed import flushed_manifests, import_flushed
from reft_ext.state.identity import refuse_other_runs, stamp
from reft_ext.store.slots import SEAL, SnapshotStore, read_sealed, sealed

NO_SEAL = f"has no checksum ({SEAL}): torn or foreign"


@pytest.fixture
def stores():
    """A function making stores of fresh jobs in /dev/shm, removed afterwards."""
    made = []

    def make():
        st = SnapshotStore("t" + uuid.uuid4().hex[:8], 0, 0, "/dev/shm", slots=2)
        st.reserve(64)
        made.append(st)
        return st
    yield make
    for st in made:
        st.remove()


def _snapshot(st, iteration, commit=True, **extra):
    slot, buf = st.begin(64)
    buf.fill_(iteration)
    st.finish(slot, {"iteration": iteration, "nbytes": 64, "meta": {}, **extra})
    if commit:
        st.commit(slot, iteration)
    return slot


def _unseal(path):
    with open(path) as f:
        obj = json.load(f)
    del obj[SEAL]
    with open(path, "w") as f:
        json.dump(obj, f)


def test_a_manifest_or_pointer_without_its_seal_is_refused(stores, events):
    store = stores()
    s1 = _snapshot(store, 1)
    manifest, pointer = (os.path.join(store.dir, n) for n in
                         (f"rank0.slot{s1}.json", "rank0.committed"))
    _unseal(manifest)
    _unseal(pointer)
    assert read_sealed(manifest) == (None, NO_SEAL)
    assert store.manifests() == {} and store.committed() is None  # torn slot, no pointer
    said = {(e["path"], e["kind"]) for e in events().of("untrusted_file", why=NO_SEAL)}
    assert said == {(manifest, "manifest"), (pointer, "commit_pointer")}


def _flush(src, flush_dir):
    """What the node's watcher copies: every slot's data and manifest, no pointer."""
    os.makedirs(flush_dir, exist_ok=True)
    for name in os.listdir(src.dir):
        if ".slot" in name:
            shutil.copy(os.path.join(src.dir, name), flush_dir)


@pytest.mark.parametrize("pointer", ["missing", "wrong iteration", "unsealed"])
def test_flushed_slots_without_a_valid_pointer_are_imported_uncommitted(
        stores, events, tmp_path, pointer):
    src, flush = stores(), str(tmp_path / "flush")
    older, newer = _snapshot(src, 3), _snapshot(src, 4)
    _flush(src, flush)
    path = os.path.join(flush, "rank0.committed")
    if pointer == "wrong iteration":  # names the newest slot, but another iteration
        with open(path, "w") as f:
            f.write(sealed({"slot": newer, "iteration": 5}))
    elif pointer == "unsealed":
        shutil.copy(os.path.join(src.dir, "rank0.committed"), path)
        _unseal(path)
    dst = stores()
    _snapshot(dst, 1)  # memory holds an older commit, whose pointer must not survive
    assert import_flushed(dst, flush, 64) == 4
    assert {s: m["iteration"] for s, m in dst.manifests().items()} == {older: 3, newer: 4}
    assert bytes(dst.data(newer, 64).numpy()) == bytes([4]) * 64
    assert dst.committed() is None  # finished, never committed: the newest is not taken
    why = {"missing": "is missing", "unsealed": NO_SEAL,
           "wrong iteration": f"names slot {newer} of iteration 5, which is not among the "
                              f"flushed slots"}[pointer]
    assert events().one("untrusted_file", path=path, kind="flushed", why=why)


def test_a_flushed_pointer_commits_the_slot_it_names_not_the_newest(stores, tmp_path):
    src, flush = stores(), str(tmp_path / "flush")
    older = _snapshot(src, 3)
    _snapshot(src, 4, commit=False)  # finished on this rank, never committed job-wide
    _flush(src, flush)
    shutil.copy(os.path.join(src.dir, "rank0.committed"), flush)
    dst = stores()
    assert import_flushed(dst, flush, 64) == 4
    assert dst.committed() == {"slot": older, "iteration": 3}


@pytest.fixture
def gloo(tmp_path):
    """A one-rank job (refuse_other_runs is a collective)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1),
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_manifest_without_a_run_identity_is_refused(stores, tmp_path, gloo):
    mine = {"seed": 1, "num_layers": 4}
    ours = stores()
    _snapshot(ours, 2, identity=dict(stamp(mine), run="abc"))
    assert refuse_other_runs(ours, "", mine, None) is None
    # in host memory: refused job-wide, the line names the file and what to do
    foreign = stores()
    slot = _snapshot(foreign, 2)
    why = refuse_other_runs(foreign, "", mine, None)
    path = os.path.join(foreign.dir, f"rank0.slot{slot}.json")
    assert why.startswith(f"--reft-job-id: host memory ({foreign.dir}) holds snapshots of "
                          f"another run ({path} carries no run identity: torn, or not "
                          f"written by REFT). Start this run with another --reft-job-id"), why
    # in the flush directory: the same
    flush = str(tmp_path / "flush")
    _flush(foreign, flush)
    why = refuse_other_runs(ours, flush, mine, None, flushed_manifests(flush, 0))
    assert why.startswith(f"--reft-flush-dir: {flush} holds flushed snapshots of another "
                          f"run ({os.path.join(flush, f'rank0.slot{slot}.json')} carries "
                          f"no run identity"), why


def test_the_next_snapshot_never_takes_the_committed_slot_whatever_the_pointer_file_says(
        stores):
    # begin() takes the committed slot from what this store last wrote (no file read
    # per iteration, issue 57): a pointer file torn afterwards (here: unsealed) changes
    # nothing for this process, which keeps writing the other slot
    st = stores()
    s0 = _snapshot(st, 1)
    _unseal(os.path.join(st.dir, "rank0.committed"))
    assert st.committed() is None  # the file itself is refused ...
    slot, _ = st.begin(64)
    assert slot != s0  # ... and the committed snapshot is still kept
    st.finish(slot, {"iteration": 2, "nbytes": 64, "meta": {}})
    st.commit(slot, 2)
    assert st.committed() == {"slot": slot, "iteration": 2}
    assert st.begin(64)[0] == s0
    # a new process's store (nothing written yet) reads the file
    fresh = SnapshotStore(st.job.split("/")[0], 0, 0, "/dev/shm", slots=2)
    assert fresh.begin(64)[0] == s0
    fresh.close()
