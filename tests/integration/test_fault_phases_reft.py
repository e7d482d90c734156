"""Faults inside REFT's own moments (``--inject-fault ...@PHASE``, library side): a kill
while a HAS unit is copied, inside the commit (local and job-wide), while the AOR transport ships a
step, while REFT-load reads, exchanges or rebuilds (a failure during a recovery), and a
node watcher killed halfway through its flush.

Every run must end bit-identical (state hash per rank, every later loss) to the same run
without the failure, or in a logged fall-back to the persistent checkpoint that still
ends bit-identical; the fault must really have fired; nothing hangs (torchrun's timeout)
and nothing torn is ever loaded. Layouts: PP2 x DP2 ZeRO-1 under arc,aor and DP4 under
aec (tests/harness LAYOUTS); ``--max-restarts 2`` and ATTEMPT place a second fault on
the restarted attempt (a crash, then a crash during its recovery)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import uuid

import pytest

from reft_ext.cluster import watcher
from reft_ext.load.flushed import import_flushed
from reft_ext.store.slots import SnapshotStore, sealed
from tests.harness.compare import same_as_reference
from tests.harness.recovery import (N, OWN, PARITY, REPLICA, assert_persistent_fallback,
                                    assert_recovered, reft, wait_watchers_exited)
from tests.harness.run import LAYOUTS, TINY, torchrun

ARC = ("pp2dp2-zero1", "arc,aor")  # sharding groups [0, 1] [2, 3]; ZeRO-1 shards + AOR
AEC = ("dp4", "aec")               # one sharding group [0, 1, 2, 3], XOR parity
# job-wide commits (reft_ext/store/commit.py; --reft-keep's auto choice for these 4-node
# jobs, pinned here): every rank seals a snapshot before any pointer moves, so which
# iteration a node loss recovers does not depend on how far the survivors got. The tests
# of REFT-load's own phases need it to be exact about the iteration; local commits
# (--reft-keep 3, auto above 16 nodes) are the commit and has-copy tests'
JOBWIDE = ["--reft-keep", "2"]
LOCAL = ["--reft-keep", "3"]


def _args(layout: str) -> list[str]:
    return TINY + N + LAYOUTS[layout]


def _run(layout: str, protect: str, faults: str, extra=(), env=None, restarts: int = 2):
    return torchrun(4, _args(layout) + reft(protect) + [*extra, "--inject-fault", faults],
                    max_restarts=restarts, env=env).check()


def _fired(run, rank: int, iteration: int, phase: str) -> None:
    """The observer's [FAULT] line of that spec (printed before the signal)."""
    want = f"into rank {rank} (pid"
    lines = [ln for ln in run.output.splitlines()
             if ln.startswith("[FAULT] injecting") and want in ln]
    assert any(f"at iteration {iteration}, phase {phase}" in ln for ln in lines), \
        (rank, iteration, phase, lines or run.output[-3000:])


# ---- commit: some commit pointers moved, others not ----------------------------------
# slow tier (both): the default tier keeps a failure inside a recovery through
# test_inprocess.py (a kill inside REFT-load of the recovery, exact) and the chaos campaign
@pytest.mark.slow
@pytest.mark.parametrize("layout,protect,commits", [(*ARC, "local"), (*AEC, "job-wide")])
def test_kill_inside_commit_then_inside_its_recovery(layout, protect, commits,
                                                     reference_runs):
    """Attempt 0: rank 1 dies inside the commit of snapshot 3 (during iteration 4), its
    snapshot sealed and its commit pointer not moved: rank 1 points at 2. Job-wide
    commits: after the all-reduce, so every rank has sealed 3 and ranks 0, 2, 3 point at
    3: REFT-load takes the newest pointer (3), which every rank holds. Local commits (no
    collective): the others point at 2 or 3, and REFT-load takes the oldest (2), which
    every rank still holds (each keeps 3 slots). Attempt 1: rank 2 dies during that
    recovery, after the inventory reads. Attempt 2 recovers the same iteration again
    from the same host memory, untouched by the interrupted recovery."""
    ref = reference_runs(layout, 4, _args(layout))
    want = 3 if commits == "job-wide" else 2
    run = _run(layout, protect, f"1:3:KILL::0@commit,2:{want}:KILL::1@load-read",
               extra=JOBWIDE if commits == "job-wide" else LOCAL)
    _fired(run, 1, 3, "commit")
    _fired(run, 2, want, "load-read")
    # the kill did land between the pointers: rank 1's at 2, the others' at 3 (seen by
    # attempt 1's recovery; rank 1 moves its own to the restored slot in its restore,
    # which it usually reaches before rank 2's death stops the job); local commits: the
    # others may not have sealed 3 yet (then all point at 2)
    differ = [(e["oldest"], e["newest"], e["chosen"])
              for e in run.events_of("commit_pointers_differ")]
    if commits == "job-wide":
        assert differ[:1] == [(2, 3, 3)] and set(differ) == {(2, 3, 3)}, differ
    else:
        assert set(differ) <= {(2, 3, 2)}, differ
    # only attempt 2's recovery completed (the interrupted one logged nothing)
    assert [e["iteration"] for e in run.events_of("recovery")] == [want], \
        run.events_of("recovery")
    assert_recovered(run.events, want, {r: OWN for r in range(4)})
    same_as_reference(run, ref, want + 1)


@pytest.mark.slow
def test_lost_node_inside_commit_then_kill_during_decode(reference_runs):
    """DP4 aec. Attempt 0: rank 2's node is lost inside the commit of snapshot 3 (its
    pointer never moved, its memory is gone; the others point at 3). Attempt 1: rank 0
    dies during the parity decode of rank 2's slice. Attempt 2 decodes again, from the
    same parities."""
    layout, protect = AEC
    ref = reference_runs(layout, 4, _args(layout))
    run = _run(layout, protect, "2:3:KILL:node:0@commit,0:3:KILL::1@load-rebuild",
               extra=JOBWIDE)
    assert "[FAULT] wiped failure domain 2" in run.output
    _fired(run, 2, 3, "commit")
    _fired(run, 0, 3, "load-rebuild")
    assert [e["iteration"] for e in run.events_of("recovery")] == [3]
    assert_recovered(run.events, 3, {2: PARITY, 0: OWN, 1: OWN, 3: OWN})
    same_as_reference(run, ref, 4)


@pytest.mark.slow
def test_two_losses_across_a_recovery_fall_back_to_persistent(tmp_path, reference_runs):
    """DP4 aec, no flush tier. Rank 2's node is lost inside a commit, then rank 0's node
    during the decode that would rebuild it: two members of the one sharding group have
    lost their memory, more than aec rebuilds; the log says so and the job resumes from
    the persistent checkpoint of iteration 2, bit-identical in the end."""
    layout, protect = AEC
    ref = reference_runs(layout, 4, _args(layout))
    save = str(tmp_path / "ckpt")
    run = _run(layout, protect, "2:3:KILL:node:0@commit,0:3:KILL:node:1@load-rebuild",
               extra=["--save", save, "--load", save, "--save-interval", "2",
                      "--reft-flush-dir", "none", *JOBWIDE])
    assert run.output.count("[FAULT] wiped failure domain") == 2
    _fired(run, 0, 3, "load-rebuild")
    assert_persistent_fallback(run.events, 2, save, reason="iteration 3: sharding group ")
    same_as_reference(run, ref, 3)


# ---- HAS copy, AOR transport ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout,protect", [ARC, AEC])
def test_kill_while_a_has_unit_is_copied(layout, protect, reference_runs):
    """Rank 1 dies while the snapshot of iteration 4 is being copied (its first unit
    done, during iteration 5): 4 was never committed on rank 1, every rank goes back to 3
    (local commits: the others may have sealed 4; none is two ahead, 3 is everywhere)."""
    ref = reference_runs(layout, 4, _args(layout))
    run = _run(layout, protect, "1:4:KILL::0@has-copy", extra=LOCAL)
    _fired(run, 1, 4, "has-copy")
    assert_recovered(run.events, 3, {r: OWN for r in range(4)})
    same_as_reference(run, ref, 4)


@pytest.mark.slow
def test_lost_node_inside_the_aor_step_then_kill_during_exchange(reference_runs):
    """PP2 x DP2 ZeRO-1 arc,aor. Attempt 0: rank 2's node is lost inside the optimizer
    step of iteration 4, its AOR message to its holder (rank 3) posted: snapshot 3 is
    committed, its slice comes from rank 3's ARC replica and its optimizer shard from
    rank 3's AOR replica, both as of iteration 3. Attempt 1: rank 3, the provider, dies
    during the slice exchange. Attempt 2 recovers 3 again."""
    layout, protect = ARC
    ref = reference_runs(layout, 4, _args(layout))
    run = _run(layout, protect, "2:4:KILL:node:0@aor,3:3:KILL::1@load-exchange",
               extra=JOBWIDE)
    assert "[FAULT] wiped failure domain 2" in run.output
    _fired(run, 2, 4, "aor")
    _fired(run, 3, 3, "load-exchange")
    assert [e["iteration"] for e in run.events_of("recovery")] == [3]
    assert_recovered(run.events, 3, {2: REPLICA, 0: OWN, 1: OWN, 3: OWN}, aor_from={2: 3})
    same_as_reference(run, ref, 4)


# ---- the node watcher killed halfway through its flush --------------------------------


@pytest.mark.slow
def test_flush_cut_short_is_never_imported(tmp_path, reference_runs):
    """A job on empty host memory resumes from the flush directory. Run 1: rank 1 crashes
    at iteration 5 (no restarts); each node's watcher flushes its snapshots, node 1's is
    SIGKILLed halfway (REFT_WATCHER_FAULT): one slot complete, one slot's data without
    its manifest, no commit pointer, and its ``.flushing`` marker left. Run 2 (a fresh
    job, /dev/shm emptied): ranks 0, 2, 3 import their flushed snapshots, rank 1's torn
    flush is reported and not imported, and iteration 4 is rebuilt for rank 1 from rank
    0's ARC and AOR replicas, bit-identical to the failure-free run."""
    layout, protect = ARC
    ref = reference_runs(layout, 4, _args(layout))
    job = f"flush-{uuid.uuid4().hex[:10]}"
    flush = str(tmp_path / "flush")
    base = _args(layout) + reft(protect) + ["--reft-job-id", job, "--reft-flush-dir", flush]
    env = {watcher.FAULT_ENV: watcher.fault_spec(1, 0)}
    try:
        first = torchrun(4, base + ["--inject-fault", "1:5"], env=env)
        assert first.returncode != 0
        _fired(first, 1, 5, "step")
        wait_watchers_exited("/dev/shm", job, range(4))
        fault = first.events.one("fault", phase="flush")
        assert fault["node"] == 1 and "[FAULT] watcher of node 1" in first.output
        flushed = {e["node"]: e for e in first.events_of("flushed")}
        assert sorted(flushed) == [0, 2, 3], flushed  # node 1's watcher never finished
        assert os.path.exists(os.path.join(flush, "rank1.flushing"))
        assert not any(os.path.exists(os.path.join(flush, f"rank{r}.flushing"))
                       for r in (0, 2, 3))
        assert not os.path.exists(os.path.join(flush, "rank1.committed"))
        # half of it there: one slot whole, the other's data without its manifest
        assert len(glob.glob(os.path.join(flush, "rank1.slot*.json"))) == 1
        assert len(glob.glob(os.path.join(flush, "rank1.slot*.bin"))) == 2
    finally:  # the new job starts on empty host memory (node dirs, status files)
        for p in glob.glob(os.path.join("/dev/shm", f"reft-{job}")):  # the job's parent
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    run = torchrun(4, base).check()
    assert run.events.one("untrusted_file", rank=1, kind="flushed")["path"] == \
        os.path.join(flush, "rank1.flushing")
    assert sorted(e["rank"] for e in run.events_of("imported_flushed")) == [0, 2, 3]
    assert_recovered(run.events, 4, {1: REPLICA, 0: OWN, 2: OWN, 3: OWN}, aor_from={1: 0})
    same_as_reference(run, ref, 5)


def _fake_slot(d: str, rank: int, slot: int, iteration: int, data: bytes) -> None:
    from reft_ext.store.slots import sealed

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"rank{rank}.slot{slot}.bin"), "wb") as f:
        f.write(data)
    with open(os.path.join(d, f"rank{rank}.slot{slot}.json"), "w") as f:
        f.write(sealed({"rank": rank, "iteration": iteration, "nbytes": len(data)}))


def test_watcher_killed_halfway_leaves_a_marker_that_blocks_the_import(tmp_path):
    """The watcher's flush without torchrun: REFT_WATCHER_FAULT kills it (a child process)
    after one of two slots; the rank's marker stays and import_flushed refuses the rank's
    files, old (an earlier whole flush) and new alike. A whole flush later clears it."""
    import subprocess
    import sys

    node, out = str(tmp_path / "node"), str(tmp_path / "flush")
    _fake_slot(node, 0, 0, 6, bytes(range(64)))
    _fake_slot(node, 0, 1, 7, bytes(range(64, 128)))
    with open(os.path.join(node, "rank0.committed"), "w") as f:
        f.write(sealed({"slot": 1, "iteration": 7}))
    _fake_slot(out, 0, 1, 3, bytes(64))  # an earlier, whole flush
    code = ("import sys; from reft_ext.cluster import watcher; "
            "watcher.flush_node(sys.argv[1], sys.argv[2], 0)")
    env = dict(os.environ, **{watcher.FAULT_ENV: watcher.fault_spec(0)},
               TORCHELASTIC_RESTART_COUNT="0")
    p = subprocess.run([sys.executable, "-c", code, node, out], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert "[FAULT] watcher of node 0" in p.stdout
    assert sorted(os.listdir(out)) == ["rank0.flushing", "rank0.slot0.bin", "rank0.slot0.json",
                                       "rank0.slot1.bin"]
    store = SnapshotStore("j", 0, 0, str(tmp_path / "shm"))
    store.reserve(64)
    assert import_flushed(store, out, 64) is None and store.manifests() == {}
    # another attempt's watcher (no fault for it) flushes the whole node: usable again
    env["TORCHELASTIC_RESTART_COUNT"] = "1"
    p = subprocess.run([sys.executable, "-c", code, node, out], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not os.path.exists(os.path.join(out, "rank0.flushing"))
    assert import_flushed(store, out, 64) == 7
    assert store.committed() == {"slot": 1, "iteration": 7}
    store.remove()


def test_flush_fault_spec_names_node_and_attempt(monkeypatch):
    monkeypatch.setenv(watcher.FAULT_ENV, ",".join(["flush:x", watcher.fault_spec(2, 1),
                                                    watcher.fault_spec(0)]))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("REFT_NODE_GENERATION", raising=False)
    assert watcher.flush_fault(2) and not watcher.flush_fault(0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert watcher.flush_fault(0) and not watcher.flush_fault(2)
    monkeypatch.delenv(watcher.FAULT_ENV)
    assert not watcher.flush_fault(0)


def test_flush_leaves_out_a_slot_rewritten_while_it_is_copied(tmp_path, monkeypatch):
    """A restarted worker may begin its next snapshot in a slot the previous attempt's
    watcher is still copying (its manifest deleted first, then new bytes): that slot is
    not flushed, never an old manifest beside new bytes."""
    node, out = str(tmp_path / "node"), str(tmp_path / "flush")
    _fake_slot(node, 0, 0, 6, bytes(64))
    _fake_slot(node, 0, 1, 7, bytes(range(64)))
    copy = watcher._copy_durable

    def racing(src, dst):  # slot 1 rewritten (manifest gone, new bytes) mid-copy
        if src.endswith("slot1.bin"):
            os.unlink(os.path.join(node, "rank0.slot1.json"))
            with open(src, "r+b") as f:
                f.write(b"\xff" * 64)
        copy(src, dst)

    monkeypatch.setattr(watcher, "_copy_durable", racing)
    assert watcher.flush_node(node, out) == {0: [6]}
    assert not os.path.exists(os.path.join(out, "rank0.slot1.json"))
    assert not os.path.exists(os.path.join(out, "rank0.flushing"))
