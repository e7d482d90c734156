"""The supervisor's start-up watch (reft_ext/cluster/startup_watch.py) on real processes
(one spinning, one asleep as a rank blocked in a collective, one stopped), how a
generation's failure is named, and the launcher's exit status (tools/launch_nodes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from reft_ext.cluster.startup_watch import StartupWatch, cpu_seconds, stopped
from reft_ext.cluster.supervisor import EXIT_PREEMPTED, failure_kind
from tools.launch_nodes import job_exit


@pytest.fixture
def procs():
    started = []

    def start(code: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code])
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()
        p.wait()


def _watch_until(w: StartupWatch, pids, marks: int, ranks: int, seconds: float):
    """Look every CHECK_S for ``seconds``; the first silence reported, else None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if w.due():
            silent = w.check([cpu_seconds(p) for p in pids], marks, ranks)
            if silent is not None:
                return silent
        time.sleep(0.05)
    return None


def test_a_generation_whose_ranks_all_sleep_is_reported_and_one_computing_is_not(procs):
    asleep = procs("import time; time.sleep(600)")
    busy = procs("while True: pass")
    time.sleep(0.5)  # past the interpreter's start (CPU)
    w = StartupWatch(hang_timeout=0.5)  # limit 1 s
    w.begin(3)
    # one rank computing (a cold replacement importing): progress, however long
    assert _watch_until(w, [asleep.pid, busy.pid], 0, 2, 3.0) is None
    # every rank asleep: reported once silent for longer than the limit
    w.begin(4)
    silent = _watch_until(w, [asleep.pid], 0, 2, 6.0)
    assert silent is not None and silent > 1.0
    assert "generation 4's start-up made no progress" in w.reason(silent)


# a process whose only busy thread is named as gloo's TCP loop (which wakes on timeouts of
# its own while its rank waits in a collective): not progress
_GLOO_LOOP = """
import ctypes, threading, time
def spin():
    ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)  # PR_SET_NAME
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
time.sleep(600)
"""


def test_gloo_loop_threads_are_not_progress(procs):
    p = procs(_GLOO_LOOP)
    time.sleep(1.0)
    before = cpu_seconds(p.pid)
    time.sleep(1.0)
    assert cpu_seconds(p.pid) == before  # the spinning thread is left out
    with open(f"/proc/{p.pid}/stat") as f:  # ... though the process did use CPU
        fields = f.read().rsplit(")", 1)[1].split()
    assert (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") > before


def test_marks_are_progress_and_every_rank_marked_ends_the_watch(procs):
    asleep = procs("import time; time.sleep(600)")
    time.sleep(0.3)
    w = StartupWatch(hang_timeout=0.5)
    w.begin(1)
    assert _watch_until(w, [asleep.pid], 2, 2, 2.0) is None  # both ranks trained
    assert w.finished and not w.due()
    off = StartupWatch(hang_timeout=0)  # --reft-hang-timeout 0: not watched
    off.begin(1)
    assert not off.enabled and not off.due()


def test_cpu_unknown_counts_as_progress():
    w = StartupWatch(hang_timeout=0.5)
    w.begin(1)
    assert _watch_until(w, [None], 0, 1, 2.0) is None  # another host's worker


def test_a_stopped_process_is_told(procs):
    p = procs("import time; time.sleep(600)")
    time.sleep(0.3)
    assert not stopped(p.pid)
    p.send_signal(signal.SIGSTOP)
    deadline = time.time() + 10
    while not stopped(p.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert stopped(p.pid)
    assert cpu_seconds(999999999) is None and not stopped(None)


def test_how_a_generation_failed_without_its_numbers():
    assert failure_kind([1], "") == "rank(s) [1] exited"
    assert failure_kind([1], "supervisor: generation 2's start-up made no progress for "
                             "11 s") == "its start-up stalled"
    a = failure_kind([], "rank 0: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:20402")
    b = failure_kind([], "rank 1: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:31999")
    assert a == b


@pytest.mark.parametrize("codes, stopped_, flushed, in_process, want", [
    ({0: 0, 1: 0}, False, False, True, 0),                 # finished
    ({0: 1, 1: 1}, False, False, True, 1),                 # failed
    ({0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, True, True, True, EXIT_PREEMPTED),
    ({0: 1, 1: 1}, True, True, True, 1),                   # issue 49: SIGTERM, nodes 1
    ({0: EXIT_PREEMPTED}, True, False, True, 1),           # the flush did not finish
    ({0: 1, 1: 1}, True, True, False, EXIT_PREEMPTED),     # torchrun agents: the flush
    ({0: 1, 1: 1}, True, False, False, 1),
])
def test_the_launchers_exit_status(codes, stopped_, flushed, in_process, want):
    assert job_exit(codes, stopped_, flushed, in_process) == want
