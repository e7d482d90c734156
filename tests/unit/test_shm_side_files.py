"""Issue 30 (findings 3, 4, 6): nothing another local user can plant is trusted.

* the node's status, watcher pid file and handover notes live in the node's private side
  directory ``<shm>/reft-<job>-node<n>.meta`` (0700, this user's): files planted at the
  old world-creatable names in /dev/shm have no effect, a side directory squatted by
  another user is refused (written) or ignored (read) with a line naming it;
* temporaries are unpredictable and created O_EXCL|O_NOFOLLOW; the flush directory is
  created 0700 and refused (nothing written, nothing loaded) when another user's or
  writable by group/others;
* a job id longer than 64 characters keeps a hash of the whole id, never a plain cut.

Real files in /dev/shm and temporary directories; the other user is ``nobody`` via
setpriv (those parts skip when not root or setpriv is missing).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from reft_ext.cluster import status, watcher
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.store import atomic, paths
from reft_ext.store.slots import sealed

NOBODY = 65534
_SETPRIV = shutil.which("setpriv")
needs_other_user = pytest.mark.skipif(
    os.geteuid() != 0 or _SETPRIV is None,
    reason="needs root and setpriv to act as another local user (nobody)")


def as_nobody(*cmd: str) -> None:
    subprocess.run([_SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                    "--clear-groups", *cmd], check=True, capture_output=True)


@pytest.fixture
def shm():
    """A world-writable sticky directory on the real /dev/shm, as /dev/shm itself."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="reft-side-test-", dir=base)
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def public(tmp_path):
    """A directory every user can reach and create in, sticky as /tmp (pytest's
    tmp_path is not: 0700 parents)."""
    d = tempfile.mkdtemp(prefix="reft-side-pub-")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _fake_slot(node_dir, rank, slot, iteration, payload: bytes):
    os.makedirs(node_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(node_dir, f"rank{rank}.slot{slot}.bin"), "wb") as f:
        f.write(payload)
    with open(os.path.join(node_dir, f"rank{rank}.slot{slot}.json"), "w") as f:
        f.write(sealed({"iteration": iteration, "rank": rank, "nbytes": len(payload)}))


def _plant(path: str, text: str, other_user: bool) -> None:
    if other_user:
        as_nobody(sys.executable, "-c",
                  f"open({path!r}, 'w').write({text!r})")
    else:
        with open(path, "w") as f:
            f.write(text)


# ---- finding 3: side files ---------------------------------------------------------------
def test_side_files_live_in_the_private_side_directory(shm):
    status.write(shm, "j", 0, status.HEALTHY, ranks=[0])
    side = paths.side_dir(shm, "j", 0)
    assert status.path(shm, "j", 0) == os.path.join(side, "status.json")
    assert status.watcher_pid_path(shm, "j", 0) == os.path.join(side, "watcher.pid")
    st = os.lstat(side)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
    assert os.stat(status.path(shm, "j", 0)).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(shm)) == ["reft-j"]  # the job's private parent only
    assert sorted(os.listdir(os.path.join(shm, "reft-j"))) == ["node0.meta"]
    assert status.jobs(shm) == ["j"] and status.read_job(shm, "j")[0]["state"] == "HEALTHY"


@pytest.mark.parametrize("other_user", [
    False, pytest.param(True, marks=needs_other_user)], ids=["self", "nobody"])
def test_planted_finished_and_pid_at_old_names_have_no_effect(shm, tmp_path, other_user):
    """The reproduced attack: FINISHED planted at the old public status name made the
    watcher exit without flushing; a planted pid file failed the start."""
    job = "p3"
    _plant(os.path.join(shm, f"reft-{job}-node0.status.json"),
           json.dumps({"node": 0, "state": "FINISHED"}), other_user)
    _plant(os.path.join(shm, f"reft-{job}-node0.watcher.pid"), "1", other_user)
    flush = str(tmp_path / "flush")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _fake_slot(paths.node_dir(shm, job, 0), 0, 0, 3, b"x" * 32)
        pid = watcher.spawn(shm, job, 0, [worker.pid], flush)  # the start works
        assert status.watcher_pid(shm, job, 0) == pid
    finally:
        worker.kill()
        worker.wait()
    assert status.wait_watchers(shm, job, 20)
    rec = status.read(shm, job, 0)
    assert rec["state"] == "UNHEALTHY" and "iterations [3]" in rec["detail"], rec
    assert os.path.exists(os.path.join(flush, "rank0.slot0.json"))  # it flushed


@needs_other_user
def test_side_directory_of_another_user_is_refused_and_never_read(shm, tmp_path):
    job = "sq"
    side, parent = paths.side_dir(shm, job, 0), paths.job_parent(shm, job)
    as_nobody("mkdir", "-m", "0777", parent)  # the job's parent, made first by another user
    as_nobody("mkdir", "-m", "0777", side)
    _plant(os.path.join(side, "status.json"), json.dumps({"node": 0, "state": "FINISHED"}),
           True)
    _plant(os.path.join(side, "watcher.pid"), str(os.getpid()), True)
    assert status.read(shm, job, 0) is None  # ignored: another user's directory
    assert status.watcher_pid(shm, job, 0) is None
    assert status.read_job(shm, job) == []
    with pytest.raises(paths.PrivateDirError) as info:
        status.write(shm, job, 0, status.HEALTHY)
    assert parent in str(info.value) and f"belongs to uid {NOBODY}" in str(info.value)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(paths.PrivateDirError) as info:
            watcher.spawn(shm, job, 0, [worker.pid], str(tmp_path / "flush"))
        assert parent in str(info.value)
    finally:
        worker.kill()
        worker.wait()
    # the ranks' signals never stop training: silently not written
    status.NodeSignals(shm, job, 0, [0], leader=True).set(status.HEALTHY)
    assert json.loads(open(os.path.join(side, "status.json")).read())["state"] == "FINISHED"


def test_own_side_directory_open_to_others_is_closed_and_files_checked(shm, tmp_path):
    side = paths.side_dir(shm, "m", 0)
    os.mkdir(os.path.dirname(side), 0o700)
    os.mkdir(side)
    os.chmod(side, 0o777)
    assert status.read(shm, "m", 0) is None  # not private: nothing read from it
    status.write(shm, "m", 0, status.HEALTHY)  # made private (0700) again
    assert os.lstat(side).st_mode & 0o777 == 0o700
    assert status.read(shm, "m", 0)["state"] == "HEALTHY"
    # a symbolic link (or a group-writable file) in it is never read
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"node": 0, "state": "FINISHED"}))
    os.unlink(status.path(shm, "m", 0))
    os.symlink(target, status.path(shm, "m", 0))
    assert status.read(shm, "m", 0) is None
    os.unlink(status.path(shm, "m", 0))
    with open(status.path(shm, "m", 0), "w") as f:
        f.write(json.dumps({"node": 0, "state": "FINISHED"}))
    os.chmod(status.path(shm, "m", 0), 0o666)
    assert status.read(shm, "m", 0) is None


def test_handover_note_in_side_directory(shm):
    from reft_ext.cluster.shrink import take_handover, write_handover
    p = write_handover(shm, "h", rank=1, node=1, world_size=2)
    assert os.path.dirname(p) == paths.side_dir(shm, "h", 1)
    assert take_handover(shm, "h") == {"rank": 1, "node": 1, "world_size": 2}
    assert take_handover(shm, "h") is None and os.listdir(shm) == []


# ---- finding 4: temporaries and the flush directory ---------------------------------------
def test_write_atomic_never_opens_a_planted_temporary(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("private")
    target = tmp_path / "committed"
    atomic.write_atomic(str(target), "old")
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "fixed")
    os.symlink(victim, atomic.tmp_name(str(target)))
    with pytest.raises(FileExistsError):
        atomic.write_atomic(str(target), "new")
    assert victim.read_text() == "private" and target.read_text() == "old"
    monkeypatch.undo()
    atomic.write_atomic(str(target), "new")  # a fresh name: works
    assert target.read_text() == "new"
    assert os.stat(target).st_mode & 0o777 == 0o600


def _victim(public) -> str:
    vdir = os.path.join(public, "victim")
    os.mkdir(vdir, 0o755)
    v = os.path.join(vdir, "secret")
    with open(v, "w") as f:
        f.write("root's private file")
    os.chmod(v, 0o644)
    return v


@needs_other_user
def test_flush_refuses_a_flush_dir_open_to_others(public, tmp_path):
    """The reproduced attack: a symlink planted in a 0777 flush dir made the flush
    overwrite another user's file. Now the flush refuses the directory, one line naming
    it, and writes nothing there."""
    victim = _victim(public)
    flush = os.path.join(public, "flush")
    os.mkdir(flush)
    os.chmod(flush, 0o777)
    node = str(tmp_path / "node")
    _fake_slot(node, 0, 0, 4, b"a" * 64)
    for name in ("rank0.slot0.bin.tmp", "rank0.flushing.tmp", "rank0.slot0.json.tmp"):
        as_nobody("ln", "-s", victim, os.path.join(flush, name))
    before = sorted(os.listdir(flush))
    with pytest.raises(watcher.FlushDirError) as info:
        watcher.flush_node(node, flush)
    msg = str(info.value)
    assert flush in msg and "writable by group or others" in msg and "not used" in msg
    assert open(victim).read() == "root's private file"
    assert sorted(os.listdir(flush)) == before  # nothing written there


@needs_other_user
def test_flush_refuses_another_users_flush_dir(public, tmp_path):
    flush = os.path.join(public, "flush")
    as_nobody("mkdir", "-m", "0700", flush)
    node = str(tmp_path / "node")
    _fake_slot(node, 0, 0, 4, b"a" * 64)
    with pytest.raises(watcher.FlushDirError) as info:
        watcher.flush_node(node, flush)
    assert flush in str(info.value) and f"belongs to uid {NOBODY}" in str(info.value)
    assert os.listdir(flush) == []


def test_watcher_reports_an_untrusted_flush_dir(shm, tmp_path):
    flush = tmp_path / "flush"
    flush.mkdir()
    os.chmod(flush, 0o777)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _fake_slot(paths.node_dir(shm, "uf", 0), 0, 0, 3, b"x" * 32)
    watcher.spawn(shm, "uf", 0, [worker.pid], str(flush))
    worker.kill()
    worker.wait()
    assert status.wait_watchers(shm, "uf", 20)
    rec = status.read(shm, "uf", 0)
    assert rec["state"] == "UNHEALTHY" and f"--reft-flush-dir: {flush} is writable by " \
        f"group or others" in rec["detail"], rec
    assert os.listdir(flush) == []


def test_flush_creates_a_private_dir(tmp_path):
    node, flush = str(tmp_path / "node"), str(tmp_path / "out" / "flush")
    _fake_slot(node, 0, 0, 4, b"a" * 64)
    assert watcher.flush_node(node, flush) == {0: [4]}
    assert os.stat(flush).st_mode & 0o777 == 0o700
    assert not [n for n in os.listdir(flush) if n.endswith(".tmp")]


def test_import_and_config_refuse_an_untrusted_flush_dir(tmp_path):
    from reft_ext.load.flushed import flushed_manifests, import_flushed
    from reft_ext.store.slots import SnapshotStore
    flush = str(tmp_path / "flush")
    _fake_slot(flush, 3, 1, 9, bytes(range(128)))  # "forged" by whoever can write there
    os.chmod(flush, 0o777)
    store = SnapshotStore("untrusted-flush", 0, 3, str(tmp_path / "shm"))
    try:
        store.reserve(128)
        assert flushed_manifests(flush, 3) == {}
        assert import_flushed(store, flush, 128) is None
        assert store.manifests() == {}
    finally:
        store.remove()
    with pytest.raises(ReftConfigError, match="--reft-flush-dir: .* writable by group"):
        ReftConfig(flush_dir=flush)
    os.chmod(flush, 0o700)
    assert flushed_manifests(flush, 3)  # private again: used
    assert ReftConfig(flush_dir=flush).flush_dir == flush


# ---- finding 6: long job ids ----------------------------------------------------------------
def test_long_job_ids_keep_a_hash_not_a_cut(tmp_path):
    a, b = "x" * 64 + "a" * 36, "x" * 64 + "b" * 36
    ja, jb = ReftConfig(job_id=a).job_id, ReftConfig(job_id=b).job_id
    assert ja != jb and len(ja) <= 64 and len(jb) <= 64 and ja.startswith("x" * 48)
    assert paths.node_dir(str(tmp_path), ja, 0) != paths.node_dir(str(tmp_path), jb, 0)
    assert ReftConfig(job_id=ja).job_id == ja  # stable when validated again
    assert ReftConfig(job_id="short/id").job_id.startswith("short_id-")  # + a hash
    assert ReftConfig(job_id="y" * 64).job_id == "y" * 64


def test_signals_check_the_side_directory_once_and_again_when_it_went(shm):
    # the directory is walked from the root at the first signal only (two signals per
    # snapshot, every iteration: issue 57); one removed (the job's cleanup) is made
    # again, private, at the next signal
    sig = status.NodeSignals(shm, "sig", 0, [0, 1], leader=True)
    calls = []
    real = paths.ensure_side_dir
    paths.ensure_side_dir = lambda *a: calls.append(a) or real(*a)
    try:
        sig.set(status.SNAP, detail="snapshot of iteration 1")
        sig.set(status.COMPLETED, 1)
        sig.set(status.SNAP, detail="snapshot of iteration 2")
        assert len(calls) == 1
        assert status.read(shm, "sig", 0)["state"] == "SNAP"
        shutil.rmtree(os.path.dirname(paths.side_dir(shm, "sig", 0)))
        sig.set(status.COMPLETED, 2)
        assert len(calls) == 2
    finally:
        paths.ensure_side_dir = real
    side = paths.side_dir(shm, "sig", 0)
    assert os.lstat(side).st_mode & 0o777 == 0o700
    rec = status.read(shm, "sig", 0)
    assert (rec["state"], rec["iteration"], rec["ranks"]) == ("COMPLETED", 2, [0, 1])


def test_snapshot_signals_are_written_at_most_once_per_interval(shm, monkeypatch):
    # SNAP and COMPLETED alternate every iteration: the status file is replaced at most
    # once per min_interval_s by them (issue 57); any other state at once
    sig = status.NodeSignals(shm, "rate", 0, [0], leader=True, min_interval_s=0.3)
    writes = []
    real = status._write
    monkeypatch.setattr(status, "_write", lambda *a, **k: writes.append(a[3]["state"])
                        or real(*a, **k))
    sig.set(status.HEALTHY)
    for it in range(1, 6):
        sig.set(status.SNAP, detail=f"snapshot of iteration {it}")
        sig.set(status.COMPLETED, it)
    assert writes == ["HEALTHY", "SNAP"]
    time.sleep(0.35)
    sig.set(status.COMPLETED, 6)  # the interval passed: written, with the last iteration
    sig.set(status.UNHEALTHY)     # another state: at once
    assert writes == ["HEALTHY", "SNAP", "COMPLETED", "UNHEALTHY"]
    rec = status.read(shm, "rate", 0)
    assert (rec["state"], rec["iteration"]) == ("UNHEALTHY", 6)
