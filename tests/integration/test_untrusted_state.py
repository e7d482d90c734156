"""Never load the wrong state: damaged manifests, commit pointers and replicas, a
shared-memory directory of another user, a changed layout, a full tmpfs, and a
checkpoint of another run. Each end-to-end case asserts that the fault fired and the
exact outcome: bit-identical to the failure-free run, or the exact logged fallback or
refusal. The cheap unit checks run in `make test`; the torchrun ones are slow."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import (N, OWN, REPLICA, assert_persistent_fallback,
                                    assert_recovered, reft)
from tests.harness.run import LAYOUTS, REPO, TINY, torchrun

from reft_ext.store.paths import node_dir
from reft_ext.store.shm import ShmDirError, ShmSegment, ShmSpaceError, ensure_private_dir
from reft_ext.store.slots import SEAL, SnapshotStore

ROOT = os.geteuid() == 0


def _rewrite(path, **changes):
    """Change values of a sealed JSON file and keep its stored checksum (a bit flip that
    still parses)."""
    with open(path) as f:
        obj = json.load(f)
    obj.update(changes)
    with open(path, "w") as f:
        json.dump(obj, f)


@pytest.fixture
def store():
    st = SnapshotStore("t" + uuid.uuid4().hex[:8], 0, 0, "/dev/shm", slots=2)
    yield st
    st.remove()


def _snapshot(st, iteration, commit=True):
    slot, buf = st.begin(64)
    buf.fill_(iteration)
    st.finish(slot, {"iteration": iteration, "nbytes": 64, "meta": {"consumed": 8 * iteration}})
    if commit:
        st.commit(slot, iteration)
    return slot


# ---- unit: the files' own checksums -------------------------------------------------
def test_manifest_failing_its_checksum_is_a_torn_slot_reported_once(store, events, capsys):
    s1, s2 = _snapshot(store, 1), _snapshot(store, 2)
    assert {s: m["iteration"] for s, m in store.manifests().items()} == {s1: 1, s2: 2}
    assert SEAL not in store.manifests()[s2] and store.committed() == {"slot": s2,
                                                                      "iteration": 2}
    path = os.path.join(store.dir, f"rank0.slot{s1}.json")
    _rewrite(path, meta={"consumed": 16})  # valid JSON, one value changed
    assert set(store.manifests()) == {s2}
    assert set(store.manifests()) == {s2}
    # one report (event and line), however often it is read: slot s1 is torn on rank 0
    torn = events().one("untrusted_file")
    assert (torn["rank"], torn["path"], torn["kind"], torn["why"]) == \
        (0, path, "manifest", "fails its checksum (self_sha256)"), torn
    assert len(capsys.readouterr().out.splitlines()) == 1
    with open(path, "w") as f:
        f.write('{"iteration": 1, "nbytes": 6')  # does not parse: torn too, said too
    assert set(store.manifests()) == {s2}
    assert events().of("untrusted_file", path=path, kind="manifest",
                       why="does not parse as JSON")


def test_commit_pointer_failing_its_checksum_is_ignored(store, events, capsys):
    _snapshot(store, 1), _snapshot(store, 2)
    newest = _snapshot(store, 3)  # the ring came round: slot 0 again
    pointer = os.path.join(store.dir, "rank0.committed")
    _rewrite(pointer, iteration=4)  # claims a snapshot nobody committed
    assert store.committed() is None
    bad = events().one("untrusted_file")
    assert (bad["rank"], bad["path"], bad["kind"], bad["why"]) == \
        (0, pointer, "commit_pointer", "fails its checksum (self_sha256)"), bad
    assert len(capsys.readouterr().out.splitlines()) == 1
    # without a readable pointer the next snapshot still spares the newest complete one
    assert store.begin(64)[0] != newest


def test_files_without_a_checksum_are_torn(store):
    s1 = _snapshot(store, 1)
    for name in (f"rank0.slot{s1}.json", "rank0.committed"):  # every writer seals
        path = os.path.join(store.dir, name)
        with open(path) as f:
            obj = json.load(f)
        del obj[SEAL]
        with open(path, "w") as f:
            json.dump(obj, f)
    assert store.manifests() == {} and store.committed() is None


def test_flushed_manifest_failing_its_checksum_is_not_imported(store, tmp_path, events):
    from reft_ext.load.flushed import flushed_manifests

    s1 = _snapshot(store, 1)
    for ext in ("json", "bin"):
        shutil.copy(os.path.join(store.dir, f"rank0.slot{s1}.{ext}"), tmp_path)
    assert set(flushed_manifests(str(tmp_path), 0)) == {s1}
    path = str(tmp_path / f"rank0.slot{s1}.json")
    _rewrite(path, iteration=7)
    assert flushed_manifests(str(tmp_path), 0) == {}
    assert events().of("untrusted_file", path=path, kind="flushed",
                       why="fails its checksum (self_sha256)")


def test_fault_modes_parse_and_the_unknown_mode_lists_them():
    from reft_ext.testing.fault_specs import FaultSpecError, parse_fault_spec

    for mode in ("corrupt-replica", "corrupt-manifest", "corrupt-committed"):
        assert parse_fault_spec(f"1:3:CONT:{mode}").mode == mode
    with pytest.raises(FaultSpecError, match=r"unknown mode 'flip' \(node, snapshot, shm-full, "
                                             r"corrupt-send, slow, corrupt, corrupt-replica, "
                                             r"corrupt-manifest, corrupt-committed\)"):
        parse_fault_spec("1:3:KILL:flip")


@pytest.mark.skipif(not ROOT, reason="needs root to chown a directory to another user")
def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "reft-job-node0"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(ShmDirError) as err:
        ensure_private_dir(str(d))
    assert str(err.value) == (
        f"--reft-shm-dir: {d} belongs to uid 65534, not to this user (uid 0): another job "
        f"or user holds this --reft-job-id on this node. Start this job with another "
        f"--reft-job-id (or --reft-shm-dir), or remove {d} if the job that made it is over")
    assert os.listdir(d) == []


# ---- a small tmpfs: running out of shared memory ------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A tmpfs of its own, 4 MiB unless the test is parametrized with another size
    (root only: mount)."""
    size = getattr(request, "param", "4M")
    d = tmp_path / "tmpfs"
    d.mkdir()
    if not ROOT or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                   str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)


TOUCH = textwrap.dedent("""
    import mmap, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    n = os.fstat(fd).st_size
    m = mmap.mmap(fd, n)
    for off in range(0, n, 4096):  # first touch of every page
        m[off] = 1
    print("touched", n, flush=True)
""")


def test_full_tmpfs_grows_no_segment_and_reserved_pages_never_sigbus(small_tmpfs):
    seg = ShmSegment.create("job", "rank0.slot0.bin", 1 << 20, base_dir=small_tmpfs)
    sparse = os.path.join(small_tmpfs, "sparse")
    with open(sparse, "wb") as f:  # what a segment without reservation would be
        f.truncate(1 << 20)
    with open(os.path.join(small_tmpfs, "filler"), "wb") as f:  # another process fills it
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(ShmSpaceError, match="point --reft-shm-dir at a larger tmpfs"):
        seg.resize(2 << 20)  # a segment growing mid-run: a clear error, size unchanged
    assert seg.nbytes == 1 << 20 and os.path.getsize(seg.path) == 1 << 20
    ok = subprocess.run([sys.executable, "-c", TOUCH, seg.path], capture_output=True,
                        text=True)
    assert ok.returncode == 0 and "touched 1048576" in ok.stdout  # reserved: no SIGBUS
    bad = subprocess.run([sys.executable, "-c", TOUCH, sparse], capture_output=True)
    assert bad.returncode == -7  # the SIGBUS the reservation prevents (pages not there)
    seg.close()


# ---- end to end (slow) ---------------------------------------------------------------
def _remove_job_shm(job):
    """Every /dev/shm entry of --reft-job-id ``job`` (node directories, status files)."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"reft-{job}"):
            p = os.path.join("/dev/shm", name)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)


def _run_id(output):
    return re.search(r"run ([0-9a-f]{12}) \(first started", output).group(1)


@pytest.mark.slow
def test_corrupt_manifest_is_rebuilt_from_the_arc_replica(reference_runs):
    """Rank 1's manifest of iteration 4 restores one global batch too far ahead: its
    checksum catches it, the slot is torn on rank 1, the ARC replica rebuilds it."""
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") +
                   ["--inject-fault", "1:5:KILL:corrupt-manifest"], max_restarts=1).check()
    m = re.search(r"\[FAULT\] changed consumed_train_samples 32 -> 40 in rank 1's manifest "
                  r"(\S+/rank1\.slot(\d)\.json) of iteration 4 \(checksum kept\)", run.output)
    assert m, run.output[-4000:]
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    # the path names the slot (rank1.slot<N>.json): that slot is torn on rank 1
    assert run.events_of("untrusted_file", rank=1, path=m.group(1), kind="manifest",
                         why="fails its checksum (self_sha256)"), run.events.names()
    assert_recovered(run.events, 4, {1: REPLICA, 0: OWN, 2: OWN, 3: OWN})
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_corrupt_commit_pointer_is_ignored(reference_runs):
    """Rank 1's commit pointer names the uncommitted iteration 5: ignored on rank 1, the
    other ranks' commits decide, iteration 4 is restored from own memory everywhere."""
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") +
                   ["--inject-fault", "1:5:KILL:corrupt-committed"], max_restarts=1).check()
    m = re.search(r"\[FAULT\] changed rank 1's commit pointer (\S+/rank1\.committed): "
                  r"iteration 4 -> 5 \(checksum kept\)", run.output)
    assert m, run.output[-4000:]
    assert run.events_of("untrusted_file", rank=1, path=m.group(1), kind="commit_pointer",
                         why="fails its checksum (self_sha256)"), run.events.names()
    assert_recovered(run.events, 4, {r: OWN for r in range(4)})
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_corrupt_manifest_without_protection_falls_back_to_persistent(tmp_path,
                                                                      reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("none") + [
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "1:5:KILL:corrupt-manifest"], max_restarts=1).check()
    assert "[FAULT] changed consumed_train_samples 32 -> 40 in rank 1's manifest" in run.output
    assert any(re.fullmatch(r"\S+/rank1\.slot\d\.json", e["path"]) and
               e["why"].startswith("fails its checksum")
               for e in run.events_of("untrusted_file", rank=1)), run.events.names()
    assert_persistent_fallback(run.events, 4, save, reason=(
        "the persistent checkpoint (iteration 4) is newer than host memory (iteration 3); "
        "iteration 4: sharding group [0, 1] lost the slices of ranks [1], more than "
        "--reft-protect none can rebuild"))
    assert not run.events_of("identity_mismatch")  # the run's own checkpoint
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_own_slice_and_its_replica_both_corrupt_fall_back_to_persistent(tmp_path,
                                                                        reference_runs):
    """Snapshots every 2 iterations: at 5 rank 0 flips a byte of the replica it holds of
    rank 1's slice (SIGCONT: it trains on), at 6 rank 1 flips its own slice and dies.
    Both copies of slice 1 of iteration 4 are bad: the persistent checkpoint of 4."""
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") + [
        "--reft-snapshot-every", "2", "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "0:5:CONT:corrupt-replica,1:6:KILL:corrupt"],
        max_restarts=1).check()
    assert ("[FAULT] flipped a byte of rank 0's ARC replica of rank 1's slice in its "
            "snapshot of iteration 4") in run.output
    assert "[FAULT] injecting SIGCONT into rank 0 (pid" in run.output
    assert "[FAULT] flipped a byte of rank 1's snapshot of iteration 4" in run.output
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert_persistent_fallback(run.events, 4, save, reason=(
        "the persistent checkpoint (iteration 4) is newer than host memory (iteration 2); "
        "iteration 4: sharding group [0, 1] lost the slices of ranks [1], more than "
        "--reft-protect arc can rebuild"))
    same_as_reference(run, ref, 5)


DP2 = ["--train-iters", "3", "--global-batch-size", "4", "--reft-snapshot-every", "1",
       "--reft-protect", "arc", "--reft-ranks-per-node", "1"]


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="needs root to chown a directory to another user")
def test_shm_dir_of_another_user_stops_the_job_before_training():
    job = f"owner-{uuid.uuid4().hex[:8]}"
    d = node_dir("/dev/shm", job, 0)
    os.mkdir(d, 0o700)
    os.chown(d, 65534, 65534)
    try:
        run = torchrun(2, TINY + DP2 + ["--reft-job-id", job])
        assert run.returncode != 0
        line = (f"error: --reft-shm-dir: {d} belongs to uid 65534, not to this user (uid 0): "
                f"another job or user holds this --reft-job-id on this node. Start this job "
                f"with another --reft-job-id (or --reft-shm-dir), or remove {d} if the job "
                f"that made it is over")
        # every rank stops with this one line, none with a traceback of ours
        assert run.output.splitlines().count(line) == 2, run.output[-4000:]
        assert f'File "{REPO}/megatron' not in run.output
        assert f'File "{REPO}/reft_ext' not in run.output
        assert "iteration        1/" not in run.output  # before any training
        assert os.listdir(d) == [] and os.stat(d).st_uid == 65534  # never written into
    finally:
        _remove_job_shm(job)


@pytest.mark.slow
def test_changed_layout_or_failure_domains_are_refused():
    """Same --reft-job-id, same DP size: TP2xDP2 snapshots are not PP2xDP2 state, and
    snapshots cut for one rank per node are not those of two."""
    job = f"layout-{uuid.uuid4().hex[:8]}"
    tp2 = LAYOUTS["tp2dp2"]
    base = ["--train-iters", "3", "--reft-snapshot-every", "1", "--reft-protect", "arc",
            "--reft-job-id", job]
    try:
        torchrun(4, TINY + tp2 + base + ["--reft-ranks-per-node", "1",
                                         "--reft-keep-snapshots"]).check()
        pp = torchrun(4, TINY + LAYOUTS["pp2dp2"] + base + ["--reft-ranks-per-node", "1"])
        assert pp.returncode != 0
        assert ("pipeline_model_parallel_size 1 there, 2 here; tensor_model_parallel_size "
                "2 there, 1 here). Start this run with another --reft-job-id") in pp.output
        rpn = torchrun(4, TINY + tp2 + base + ["--reft-ranks-per-node", "2"])
        assert rpn.returncode != 0
        assert ("iteration 3: reft_ranks_per_node 1 there, 2 here). Start this run with "
                "another --reft-job-id") in rpn.output
        for out in (pp.output, rpn.output):
            assert f"error: --reft-job-id: host memory (/dev/shm/reft-{job}/node0)" in out
            assert "iteration        1/" not in out
    finally:
        _remove_job_shm(job)


@pytest.mark.slow
@pytest.mark.parametrize("small_tmpfs", ["1M"], indirect=True)  # < one slot of a rank
def test_snapshots_that_do_not_fit_stop_the_job_before_training(small_tmpfs):
    run = torchrun(2, TINY + DP2 + ["--reft-shm-dir", small_tmpfs])
    assert run.returncode != 0
    assert re.search(r"error: shared-memory segment \S+/rank\d\.slot\d\.bin needs "
                     r"\d+ more bytes .* point --reft-shm-dir at a larger tmpfs", run.output)
    assert "Bus error" not in run.output and "SIGBUS" not in run.output
    assert "iteration        1/" not in run.output


@pytest.mark.slow
def test_loading_another_runs_checkpoint_warns_and_loads(tmp_path):
    save = str(tmp_path / "ckpt")
    first = torchrun(1, TINY + ["--train-iters", "3", "--save", save]).check()
    other = torchrun(1, TINY + ["--train-iters", "4", "--load", save, "--seed", "7",
                                "--global-batch-size", "4",
                                "--override-opt_param-scheduler"]).check()
    warned = other.events.one("identity_mismatch")
    assert (warned["path"], warned["run"], warned["differences"]) == \
        (f"{save}/iter_0000003", _run_id(first.output),
         ["global_batch_size 2 there, 4 here", "seed 1234 there, 7 here"]), warned
    assert f"loaded checkpoint {save}/iter_0000003 at iteration 3" in other.output
    same = torchrun(1, TINY + ["--train-iters", "4", "--load", save,
                               "--use-checkpoint-opt_param-scheduler"]).check()
    assert not same.events_of("identity_mismatch")
    assert f"loaded checkpoint {save}/iter_0000003 at iteration 3" in same.output
