"""Hang detection (--reft-hang-timeout): the heartbeat record, the watcher's limits, the
watcher SIGKILLing a SIGSTOPped process, and a real 2-node job in which a frozen rank is
found and killed well before the collective timeout, after which the job recovers from
host memory and ends bit-identical to the failure-free run."""

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from tests.harness.run import REPO, TINY
from reft_ext.cluster import heartbeat
from reft_ext.cluster import status
from reft_ext.cluster import watcher
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.cluster.heartbeat import PAUSED, WAITING, WORKING, Heartbeat, HangMonitor

from tests.harness.nodes import finish, launcher
from tests.integration.test_reft_recovery import _same_as_reference


def test_heartbeat_record_follows_the_rank(tmp_path):
    hb = Heartbeat(str(tmp_path), 3, iteration=5)
    p = heartbeat.path(str(tmp_path), 3)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    rec = heartbeat.read(p)
    assert (rec["pid"], rec["iteration"], rec["state"]) == (os.getpid(), 5, PAUSED)
    hb.work()
    assert heartbeat.read(p)["state"] == PAUSED  # not armed before an iteration completes
    hb.iteration_done(6)
    assert (heartbeat.read(p)["state"], heartbeat.read(p)["iteration"]) == (WAITING, 6)
    hb.on_phase("forward-compute", True)
    assert heartbeat.read(p)["state"] == WORKING
    hb.on_phase("forward-compute", False)
    assert heartbeat.read(p)["state"] == WAITING
    hb.on_phase("optimizer-step", True)
    assert heartbeat.read(p)["state"] == WAITING
    seq = heartbeat.read(p)["seq"]
    with hb.paused():
        with hb.paused():  # a save inside the shutdown, validation inside ...
            hb.work()
        assert heartbeat.read(p)["state"] == PAUSED
    assert heartbeat.read(p)["state"] == WAITING and heartbeat.read(p)["seq"] > seq
    hb.close()
    assert not os.path.exists(p) and heartbeat.read(p) is None
    hb.work()  # after close: a no-op, not a crash


def test_monitor_limits_working_waiting_paused(tmp_path):
    d = str(tmp_path)
    hb = {r: Heartbeat(d, r) for r in range(4)}
    for h in hb.values():
        h.iteration_done(1)
    hb[0].work()
    hb[1].wait()
    hb[2].pause()
    hb[3].work()
    t = time.monotonic()  # the beats above are microseconds older
    mon = HangMonitor(d, [0, 1, 2, 3], [os.getpid()] * 3 + [1], timeout=2.0)  # 3: other pid
    assert mon.check(now=t + 1.9) == []
    hung = mon.check(now=t + 2.1)
    assert [h["rank"] for h in hung] == [0] and hung[0]["limit"] == 2.0
    line = heartbeat.describe(hung[0], node=0, timeout=2.0)
    assert line.startswith(f"rank 0 (pid {os.getpid()}, node 0) made no progress for 2.1 s "
                           f"while computing, last completed iteration 1 (limit 2 s")
    # waiting for peers: twice the timeout (it waits for the hung one, not the culprit)
    assert [h["rank"] for h in mon.check(now=t + 4.1)] == [0, 1]


_WORKER = textwrap.dedent("""
    import sys, time
    from reft_ext.cluster.heartbeat import Heartbeat
    hb = Heartbeat({node_dir!r}, {rank}, iteration=6)
    hb.iteration_done(7)
    hb.{state}()
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
""")


def _fake_rank(node_dir, rank, state):
    p = subprocess.Popen([sys.executable, "-c", _WORKER.format(
        repo=REPO, node_dir=node_dir, rank=rank, state=state)], stdout=subprocess.PIPE,
        text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_watcher_kills_a_stopped_rank_not_its_waiting_peer(tmp_path, capfd):
    """Rank 5 froze while computing (SIGSTOP, as --inject-fault R:ITER:STOP does); rank 4
    is as silent, but waiting for peers: only rank 5 is named and killed, at the timeout."""
    d, job = str(tmp_path), "hang1"
    node_dir = os.path.join(d, f"reft-{job}-node0")
    os.makedirs(node_dir)
    waiting, frozen = _fake_rank(node_dir, 4, "wait"), _fake_rank(node_dir, 5, "work")
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        t0 = time.time()
        watcher.spawn(d, job, 0, [waiting.pid, frozen.pid], "", ranks=[4, 5],
                      hang_timeout=1.0)
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        took = time.time() - t0
        assert 0.8 <= took < 2.5, took  # the last beat was just before t0
        assert waiting.poll() is None  # not blamed
        rec = status.read(d, job, 0)
        assert rec["state"] == "UNHEALTHY" and \
            rec["detail"].startswith(f"hang: rank 5 (pid {frozen.pid}, node 0)"), rec
        assert "process stopped" in rec["detail"] and "rank 4" not in rec["detail"]
    finally:
        for p in (waiting, frozen):
            p.kill()
            p.wait()
    assert status.wait_watchers(d, job, 20)
    out = capfd.readouterr().out
    assert re.search(rf"\[REFT\] hang: rank 5 \(pid {frozen.pid}, node 0\) made no progress "
                     rf"for 1\.\d s while computing, last completed iteration 7 \(limit 1 s, "
                     rf"--reft-hang-timeout 1; process stopped\); SIGKILL", out), out
    assert out.count("[REFT] hang:") == 1


def test_hang_timeout_flag_is_validated():
    with pytest.raises(ReftConfigError, match="^--reft-hang-timeout: must be 0"):
        ReftConfig(snapshot_every=1, hang_timeout=0.5)
    with pytest.raises(ReftConfigError, match="^--reft-hang-timeout: needs --reft-snapshot"):
        ReftConfig(hang_timeout=5)
    assert ReftConfig(snapshot_every=1, hang_timeout=2.5).hang_timeout == 2.5


T = 5  # --reft-hang-timeout; the collective timeout stays at its 10 minutes
N = ["--train-iters", "6"]
TP2DP2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"]


def test_frozen_rank_is_killed_and_the_job_recovers(tmp_path, reference_runs):
    """2 nodes x 2 ranks. Rank 2 freezes (SIGSTOP) before its optimizer step of iteration
    4; the others block in their collectives. Node 1's watcher names and kills rank 2
    after T seconds, torchrun restarts both nodes' workers, every rank reloads iteration 3
    from its own memory, and the run ends bit-identical to the failure-free one."""
    ref = reference_runs("nodes-tp2dp2", 4, TINY + N + TP2DP2)
    save = str(tmp_path / "ckpt")
    args = TINY + N + TP2DP2 + ["--reft-snapshot-every", "1", "--reft-protect", "arc",
                                "--reft-hang-timeout", str(T), "--save", save,
                                "--save-interval", "100", "--inject-fault", "2:4:STOP"]
    with launcher(2, 2, args, tmp_path) as L:
        L.start()
        fault = L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 2 \(pid \d+\)", timeout=90)
        t_fault = time.time()
        hang = L.wait_for(r"\[REFT\] hang: rank \d+ .*", timeout=T + 30)
        detected = time.time() - t_fault
        rec = status.read(L.cfg.shm_dir, L.job_id, 1)
        run = finish(L).check()
    pid = re.search(r"pid (\d+)", fault).group(1)
    assert hang.startswith(f"[REFT] hang: rank 2 (pid {pid}, node 1) made no progress for ")
    silent = float(re.search(r"no progress for ([0-9.]+) s", hang).group(1))
    assert T <= silent < T + 1 and T - 0.5 < detected < T + 2, (silent, detected)
    assert "while computing, last completed iteration 3" in hang and "process stopped" in hang
    assert rec["state"] == "UNHEALTHY" and "hang: rank 2" in rec["detail"], rec
    out = run.output
    assert re.findall(r"\[REFT\] hang: rank (\d+)", out) == ["2"]  # the victims not blamed
    assert "[REFT] flushed node 1's snapshots (ranks [2, 3]" in out  # save-on-failure too
    for r in range(4):
        assert f"[REFT] recovered iteration 3 on rank {r} from own memory" in out
    _same_as_reference(run, ref, 4)
