"""Hang detection (--reft-hang-timeout): the heartbeat record, the watcher's limits, the
watcher SIGKILLing a SIGSTOPped process, and a real 2-node job in which a frozen rank is
found and killed well before the collective timeout, after which the job recovers from
host memory and ends bit-identical to the failure-free run."""

import os
import stat
import time

import pytest

from tests.harness import scenarios
from reft_ext.cluster import heartbeat
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.cluster.heartbeat import PAUSED, WAITING, WORKING, Heartbeat, HangMonitor


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


def test_a_half_written_beat_is_not_read(tmp_path):
    """struct.pack_into zeroes a record before it writes the fields: a reader that caught a
    rank descheduled in between saw its pid with t = 0, a silence as long as the uptime
    (a chaos campaign's false hang verdict). Beats are now one copy of a packed record,
    and a record without a time or a sequence number is no beat."""
    hb = Heartbeat(str(tmp_path), 1)
    hb.iteration_done(6)
    p = heartbeat.path(str(tmp_path), 1)
    whole = heartbeat.read(p)
    assert whole["pid"] == os.getpid() and whole["t"] > 0
    torn = heartbeat._REC.pack(whole["seq"], 6, WAITING, os.getpid(), 0.0)  # t not yet
    hb._mm[:len(torn)] = torn
    assert heartbeat.read(p) is None
    mon = HangMonitor(str(tmp_path), [1], [os.getpid()], timeout=1.0)
    assert mon.check() == []
    hb.beat()
    assert heartbeat.read(p)["t"] > 0
    hb.close()


def test_monitor_limits_working_waiting_paused(tmp_path, monkeypatch):
    """The limits by state, judged at given moments after each rank's own beat (the
    CPU-wait discount off: it would read this very process, running the test)."""
    monkeypatch.setattr(heartbeat, "cpu_wait", lambda pid: None)
    d = str(tmp_path)
    hb = {r: Heartbeat(d, r) for r in range(4)}
    for h in hb.values():
        h.iteration_done(1)
    hb[0].work()
    hb[1].wait()
    hb[2].pause()
    hb[3].work()
    t, t1 = (heartbeat.read(heartbeat.path(d, r))["t"] for r in (0, 1))  # the last beats
    mon = HangMonitor(d, [0, 1, 2, 3], [os.getpid()] * 3 + [1], timeout=2.0)  # 3: other pid
    assert mon.check(now=t + 1.9) == []
    hung = mon.check(now=t + 2.1)
    assert [h["rank"] for h in hung] == [0] and hung[0]["limit"] == 2.0
    line = heartbeat.describe(hung[0], node=0, timeout=2.0)
    assert line.startswith(f"rank 0 (pid {os.getpid()}, node 0) made no progress for 2.1 s "
                           f"while computing, last completed iteration 1 (limit 2 s")
    # waiting for peers: twice the timeout (it waits for the hung one, not the culprit)
    assert [h["rank"] for h in mon.check(now=t1 + 3.9)] == [0]
    assert [h["rank"] for h in mon.check(now=t1 + 4.1)] == [0, 1]


_RANK = """
import sys, time
from reft_ext.cluster.heartbeat import Heartbeat
hb = Heartbeat(sys.argv[1], int(sys.argv[2]))
hb.iteration_done(1)
hb.work() if sys.argv[3] == "work" else hb.wait()
print("beat", flush=True)
if sys.argv[4] == "sleep-then-spin":  # a victim woken by its failed collective
    time.sleep(1.5)
if sys.argv[4] != "sleep":
    while True:
        pass
time.sleep(120)
"""


def test_verdict_falls_on_the_culprit_not_its_victims(tmp_path):
    """Real processes, 1 s timeout. Rank 0 froze (SIGSTOP) while it waited for peers:
    the culprit, judged at the timeout. Rank 1 computes and spins without beating: hung at
    the timeout. Rank 2 computes but sleeps in the kernel (a TP all-reduce waiting for
    rank 0): a victim, given the waiting limit, so it is still alive when rank 0's kill
    ends its collective (chaos campaigns saw such victims killed as hung). Rank 3 slept
    the same way, then runs (a victim woken by its failed collective, dying): still a
    victim, given the waiting limit."""
    import signal
    import subprocess
    import sys

    from tests.harness.run import ENV_PATH

    d = str(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, d, str(r), state, how],
                              stdout=subprocess.PIPE, env=dict(os.environ, **ENV_PATH))
             for r, (state, how) in enumerate([("wait", "sleep"), ("work", "spin"),
                                               ("work", "sleep"),
                                               ("work", "sleep-then-spin")])]
    try:
        for p in procs:
            assert p.stdout.readline() == b"beat\n"
        procs[0].send_signal(signal.SIGSTOP)
        mon = HangMonitor(d, [0, 1, 2, 3], [p.pid for p in procs], timeout=1.0)
        seen: dict[int, float] = {}
        t0 = time.monotonic()  # a bound on the wait only (a busy host: rank 1 needs 1 s
        while time.monotonic() - t0 < 60.0 and len(seen) < 4:  # of CPU to be judged hung)
            for h in mon.check():
                seen.setdefault(h["rank"], h["limit"])
            time.sleep(0.05)
        assert heartbeat.process_state(procs[0].pid) == "stopped"
        assert seen == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}, seen
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_watcher_kills_a_stopped_rank_not_its_waiting_peer(tmp_path):
    scenarios.watcher_kills_a_stopped_rank_not_its_waiting_peer(tmp_path)


def test_hang_timeout_flag_is_validated():
    with pytest.raises(ReftConfigError, match="^--reft-hang-timeout: must be 0"):
        ReftConfig(snapshot_every=1, hang_timeout=0.5)
    with pytest.raises(ReftConfigError, match="^--reft-hang-timeout: needs --reft-snapshot"):
        ReftConfig(hang_timeout=5)
    assert ReftConfig(snapshot_every=1, hang_timeout=2.5).hang_timeout == 2.5


@pytest.mark.slow  # make test's 12 minutes; the watcher killing a stopped process and
# its limits stay in the default tier (the unit-level tests above)
def test_frozen_rank_is_killed_and_the_job_recovers(tmp_path, reference_runs):
    scenarios.frozen_rank_is_killed_and_the_job_recovers(tmp_path, reference_runs)
