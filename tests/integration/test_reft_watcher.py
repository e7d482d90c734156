"""Units of the state signals, the save-on-failure watcher and the flushed tier (no
torchrun): status files, flush of complete slots only, import only when newer, the
watcher process reacting to a dead worker, and the launcher's bad-flag messages."""

import glob
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from reft_ext.cluster import status
from reft_ext.cluster import watcher
from reft_ext.load.flushed import import_flushed
from reft_ext.store.paths import node_dir
from reft_ext.store.slots import SnapshotStore, sealed

from tools.launch_nodes import LaunchConfig, LaunchError
from tools.reft_status import main as status_main, table


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_status_files_are_private_atomic_and_tabled(tmp_path, capsys):
    d = str(tmp_path)
    s0 = status.NodeSignals(d, "j", 0, [0, 1], leader=True)
    s0.set(status.HEALTHY)
    s0.set(status.COMPLETED, 7)
    s0.set(status.SNAP, detail="snapshot of iteration 8")
    status.NodeSignals(d, "j", 0, [0, 1], leader=False).set(status.OFFLINE)  # no-op
    status.write(d, "j", 1, status.OFFLINE, detail="node killed")
    recs = status.read_job(d, "j")
    assert [(r["node"], r["state"], r["iteration"]) for r in recs] == \
        [(0, "SNAP", 7), (1, "OFFLINE", None)]
    assert _mode(status.path(d, "j", 0)) == 0o600
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
    t = table(d, "j")
    assert "0-1" not in t and "0,1" in t and "SNAP" in t and "OFFLINE" in t
    assert status.jobs(d) == ["j"]
    assert status_main(["--shm-dir", d, "--job", "j"]) == 0
    assert "snapshot of iteration 8" in capsys.readouterr().out
    assert status_main(["--shm-dir", d, "--job", "nope"]) == 1
    with pytest.raises(ValueError):
        status.write(d, "j", 0, "BUSY")


def _fake_slot(node_dir, rank, slot, iteration, payload: bytes, nbytes=None):
    os.makedirs(node_dir, exist_ok=True)
    with open(os.path.join(node_dir, f"rank{rank}.slot{slot}.bin"), "wb") as f:
        f.write(payload)
    man = {"iteration": iteration, "rank": rank, "nbytes": nbytes or len(payload)}
    with open(os.path.join(node_dir, f"rank{rank}.slot{slot}.json"), "w") as f:
        f.write(sealed(man))


def test_flush_copies_complete_slots_only(tmp_path):
    node, out = str(tmp_path / "node"), str(tmp_path / "flush")
    _fake_slot(node, 0, 0, 4, b"a" * 64)
    _fake_slot(node, 0, 1, 5, b"b" * 10, nbytes=64)  # torn: data shorter than the manifest
    with open(os.path.join(node, "rank0.committed"), "w") as f:
        json.dump({"slot": 0, "iteration": 4}, f)
    assert watcher.flush_node(node, out) == {0: [4]}
    assert sorted(os.listdir(out)) == ["rank0.committed", "rank0.slot0.bin", "rank0.slot0.json"]
    assert all(_mode(os.path.join(out, n)) == 0o600 for n in os.listdir(out))


def test_import_flushed_only_when_newer_than_memory(tmp_path):
    base, flush = str(tmp_path / "shm"), str(tmp_path / "flush")
    store = SnapshotStore("job", 0, 3, base)
    store.reserve(128)
    _fake_slot(flush, 3, 1, 9, bytes(range(128)))
    with open(os.path.join(flush, "rank3.committed"), "w") as f:  # as the watcher copies it
        f.write(sealed({"slot": 1, "iteration": 9}))
    assert import_flushed(store, flush, 128) == 9
    assert store.manifests()[1]["iteration"] == 9 and store.committed()["slot"] == 1
    assert bytes(store.data(1, 128).numpy()) == bytes(range(128))
    assert import_flushed(store, flush, 128) is None  # memory now as new as the flush
    assert import_flushed(store, flush, 256) is None  # another layout: not ours
    store.remove()


def _spawned_watcher(tmp_path, job, flush):
    d = str(tmp_path)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _fake_slot(node_dir(d, job, 0), 0, 0, 3, b"x" * 32)
    pid = watcher.spawn(d, job, 0, [worker.pid], flush)
    assert status.watcher_pid(d, job, 0) == pid
    return d, worker


def _wait_gone(d, job, timeout=20):
    assert status.wait_watchers(d, job, timeout)


def test_watcher_flushes_when_a_worker_dies(tmp_path):
    flush = str(tmp_path / "flush")
    d, worker = _spawned_watcher(tmp_path, "w1", flush)
    worker.kill()
    worker.wait()
    _wait_gone(d, "w1")
    rec = status.read(d, "w1", 0)
    assert rec["state"] == "UNHEALTHY" and "iterations [3]" in rec["detail"]
    assert os.path.exists(os.path.join(flush, "rank0.slot0.json"))


def test_watcher_says_why_a_flush_fails(tmp_path):
    """A flush directory that became unusable after the start-up check (here: a file
    took its place): one line and the node's status say so, no traceback."""
    flush = tmp_path / "flush"
    d, worker = _spawned_watcher(tmp_path, "w4", str(flush / "sub"))
    flush.write_text("")
    worker.kill()
    worker.wait()
    _wait_gone(d, "w4")
    rec = status.read(d, "w4", 0)
    assert rec["state"] == "UNHEALTHY", rec
    assert f"flush of the snapshots to --reft-flush-dir {flush}/sub failed" in rec["detail"]


def test_watcher_does_nothing_after_a_normal_end(tmp_path):
    flush = str(tmp_path / "flush")
    d, worker = _spawned_watcher(tmp_path, "w2", flush)
    status.write(d, "w2", 0, status.FINISHED)
    worker.kill()
    worker.wait()
    _wait_gone(d, "w2")
    assert status.read(d, "w2", 0)["state"] == "FINISHED" and not os.path.exists(flush)


def test_watcher_reports_offline_when_memory_is_gone(tmp_path):
    d, worker = _spawned_watcher(tmp_path, "w3", str(tmp_path / "flush"))
    shutil.rmtree(node_dir(d, "w3", 0))
    worker.kill()
    worker.wait()
    _wait_gone(d, "w3")
    assert status.read(d, "w3", 0)["state"] == "OFFLINE"


@pytest.mark.parametrize("kw,flag", [(dict(nnodes=0), "--nnodes"),
                                     (dict(min_nodes=5), "--min-nodes"),
                                     (dict(nproc_per_node=0), "--nproc-per-node"),
                                     (dict(job_id="a/b"), "--job-id"),
                                     (dict(max_restarts=-1), "--max-restarts")])
def test_launcher_bad_settings_name_the_flag(kw, flag, tmp_path):
    with pytest.raises(LaunchError, match=f"^{flag}:"):
        LaunchConfig(log_dir=str(tmp_path), **kw)


def test_flush_dir_flag_defaults_under_save():
    from argparse import Namespace
    from dataclasses import fields
    from reft_ext.config import ReftConfig, ReftConfigError

    args = Namespace(**{"reft_" + f.name: f.default for f in fields(ReftConfig)}, save="/ck")
    assert ReftConfig.from_args(args).flush_dir == "/ck/reft-flush"
    args.reft_flush_dir = "none"
    assert ReftConfig.from_args(args).flush_dir == ""
    with pytest.raises(ReftConfigError, match="^--reft-flush-dir:"):
        ReftConfig(flush_dir=__file__)


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _until(cond, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_adopting_watcher_follows_in_process_generations(tmp_path):
    """--adopt (the in-process supervisor's restarts): one watcher for the job. A rank's
    death makes the node UNHEALTHY without a flush while the others live; the next
    generation's ranks are handed over (status.adopt_watcher) and watched; once every rank is gone with no hand-over the watcher
    resigns (its pid file goes) and flushes."""
    d, job, flush = str(tmp_path), "wa", str(tmp_path / "flush")
    _fake_slot(node_dir(d, job, 0), 0, 0, 3, b"x" * 32)
    a, b = _sleeper(), _sleeper()
    status.write_watch_list(d, job, 0, 0, [a.pid, b.pid], [0, 1])
    pid = watcher.spawn(d, job, 0, [a.pid, b.pid], flush, ranks=[0, 1], adopt=True)
    a.kill()
    a.wait()
    _until(lambda: (status.read(d, job, 0) or {}).get("state") == "UNHEALTHY")
    assert status.watcher_pid(d, job, 0) == pid and not os.path.exists(flush)
    c = _sleeper()  # the replacement of rank 0
    assert status.adopt_watcher(d, job, 0, 1, [c.pid, b.pid], [0, 1])
    c.kill()
    c.wait()  # a death in generation 1: still the same watcher, no flush
    _until(lambda: "died" in (status.read(d, job, 0) or {}).get("detail", "")
           and str(c.pid) in status.read(d, job, 0)["detail"])
    assert status.watcher_pid(d, job, 0) == pid and not os.path.exists(flush)
    b.kill()
    b.wait()  # the node's last rank: no generation comes, it resigns and flushes
    _until(lambda: status.watcher_pid(d, job, 0) is None, timeout=30)  # resigned
    _wait_gone(d, job, timeout=30)  # and, for what waits for the flush, done
    assert os.path.exists(os.path.join(flush, "rank0.slot0.json"))
    assert not glob.glob(os.path.join(d, "*", status.FLUSHING))
    # a node with no adopting watcher is told so: the caller starts one
    assert not status.adopt_watcher(d, job, 0, 2, [os.getpid()], [0])
