"""Real-job scenarios run twice: on an idle host (tests/integration/test_hang.py,
test_nodes.py, test_health.py) and beside busy loops (test_under_load.py). Each starts the
job, injects its fault and checks the outcome from the job's events
(tests/harness/events.py) and state hashes; a test module calls one with its fixtures, so
no test module imports another."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager

from tests.harness import events as ev
from tests.harness.compare import same_as_reference
from tests.harness.nodes import events, finish, launcher, stop_then_lose, wait_for_event
from tests.harness.recovery import N, OWN, reft
from tests.harness.run import LAYOUTS, TINY, events_file

from reft_ext.cluster import heartbeat
from reft_ext.cluster import status
from reft_ext.cluster import watcher
from reft_ext.store import paths


@contextmanager
def events_env(tmp_path):
    """REFT_EVENTS_FILE for the processes this one starts meanwhile (a watcher spawned
    from the test process inherits its environment); yields the file's path."""
    path, old = events_file(str(tmp_path)), os.environ.get(ev.ENV)
    os.environ[ev.ENV] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(ev.ENV, None)
        else:
            os.environ[ev.ENV] = old


# ---- hang detection --------------------------------------------------------------------
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
        node_dir=node_dir, rank=rank, state=state)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def watcher_kills_a_stopped_rank_not_its_waiting_peer(tmp_path):
    """Rank 5 froze while computing (SIGSTOP, as --inject-fault R:ITER:STOP does); rank 4
    is as silent, but waiting for peers: only rank 5 is named and killed, at the timeout."""
    d, job = str(tmp_path), "hang1"
    node_dir = paths.node_dir(d, job, 0)
    os.makedirs(node_dir)
    waiting, frozen = _fake_rank(node_dir, 4, "wait"), _fake_rank(node_dir, 5, "work")
    try:
        last_beat = heartbeat.read(heartbeat.path(node_dir, 5))["t"]  # time.monotonic()
        os.kill(frozen.pid, signal.SIGSTOP)
        with events_env(tmp_path) as path:
            watcher.spawn(d, job, 0, [waiting.pid, frozen.pid], "", ranks=[4, 5],
                          hang_timeout=1.0)
        assert frozen.wait(timeout=60) == -signal.SIGKILL  # (a bound on the wait only)
        # never before its limit: a second of silence since its last beat (CLOCK_MONOTONIC
        # is the machine's, the same in every process). How soon after is not asserted:
        # on a busy host that is scheduling, not the watcher's verdict
        assert time.monotonic() - last_beat >= 1.0
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
    hang = ev.load(path).one("hang")  # one report, of rank 5 alone
    assert (hang["rank"], hang["pid"], hang["node"], hang["state"], hang["iteration"],
            hang["limit_s"], hang["timeout_s"], hang["process"]) == \
        (5, frozen.pid, 0, "computing", 7, 1, 1, "stopped"), hang
    assert hang["silent_s"] >= hang["limit_s"], hang  # judged at its limit, not before


T = 5  # --reft-hang-timeout; the collective timeout stays at its 10 minutes


def frozen_rank_is_killed_and_the_job_recovers(tmp_path, reference_runs):
    """2 nodes x 2 ranks. Rank 2 freezes (SIGSTOP) before its optimizer step of iteration
    4; the others block in their collectives. Node 1's watcher names and kills rank 2
    after T seconds, torchrun restarts both nodes' workers, every rank reloads iteration 3
    from its own memory, and the run ends bit-identical to the failure-free one."""
    layout = LAYOUTS["tp2dp2"]
    ref = reference_runs("nodes-tp2dp2", 4, TINY + N + layout)
    save = str(tmp_path / "ckpt")
    args = TINY + N + layout + ["--reft-snapshot-every", "1", "--reft-protect", "arc",
                                "--reft-hang-timeout", str(T), "--save", save,
                                "--save-interval", "100", "--inject-fault", "2:4:STOP"]
    with launcher(2, 2, args, tmp_path) as L:
        L.start()
        fault = L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 2 \(pid \d+\)", timeout=90)
        # a bound on the wait only: the collective timeout (10 minutes) is far beyond it
        hang = wait_for_event(L, "hang", timeout=T + 60)
        rec = status.read(L.cfg.shm_dir, L.job_id, 1)
        run = finish(L).check()
    pid = int(re.search(r"pid (\d+)", fault).group(1))
    assert (hang["rank"], hang["pid"], hang["node"]) == (2, pid, 1), hang
    # judged at the hang timeout (a stopped rank is the culprit: not the waiting limit
    # 2 T), and not before it
    assert (hang["limit_s"], hang["timeout_s"]) == (T, T) and \
        hang["silent_s"] >= hang["limit_s"], hang
    assert (hang["state"], hang["iteration"], hang["process"]) == \
        ("computing", 3, "stopped"), hang
    # the order of what happened: the fault, the watcher's verdict, the restart that
    # loaded from host memory
    order = [e["event"] for e in run.events if e["event"] in ("fault", "hang", "recovered")]
    assert order.index("fault") < order.index("hang") < order.index("recovered"), order
    assert rec["state"] == "UNHEALTHY" and "hang: rank 2" in rec["detail"], rec
    assert [h["rank"] for h in run.events_of("hang")] == [2]  # the victims not blamed
    flushed = run.events.one("flushed", node=1)  # save-on-failure too
    assert flushed["ranks"] == [2, 3], flushed
    assert all(run.events_of("recovered", iteration=3, rank=r, source=OWN)
               for r in range(4)), run.events_of("recovered")
    same_as_reference(run, ref, 4)


# ---- a node lost and replaced -----------------------------------------------------------
def node_loss_and_replacement(protect, layout, tmp_path, reference_runs):
    """Node 1 (ranks 2, 3) is lost at iteration 4 and replaced: its slices come back from
    its peers' redundancy (and its ZeRO-1 shards from their AOR replicas)."""
    ref = reference_runs("nodes-" + layout, 4, TINY + N + LAYOUTS[layout])
    with launcher(2, 2, TINY + N + LAYOUTS[layout] + reft(protect, None) +
                  ["--inject-fault", "2:4:STOP"], tmp_path) as L:
        L.start()
        stop_then_lose(L, rank=2, nodes=[1])
        run = finish(L).check()
    assert "[FAULT] injecting SIGSTOP into rank 2" in run.output
    source, aor = ("replica", None) if protect == "arc" else ("parity", {2: 0, 3: 1})
    for rank, holder in ((2, 0), (3, 1)):
        match = {"aor_from": holder} if aor else {}
        assert run.events_of("recovered", iteration=3, rank=rank, source=source, **match), \
            (rank, run.events_of("recovered"), run.output[-3000:])
    for rank in (0, 1):
        assert run.events_of("recovered", iteration=3, rank=rank, source=OWN)
    same_as_reference(run, ref, 4)


# ---- the start-up health check stops a job that cannot shrink ---------------------------
CANNOT_SHRINK = [  # (--min-nodes, why the job stops)
    (0, "the launch is not elastic: start it with torchrun --nnodes MIN:2 and "
        "--reft-min-nodes MIN (tools/launch_nodes.py --min-nodes MIN)"),
    (1, "the layout cannot shrink to 1 ranks: --reft-protect: arc needs data-parallel "
        "size >= 2")]


def failed_node_stops_a_job_that_cannot_shrink(min_nodes, expect, tmp_path):
    """Node 1 fails at start-up; without elasticity (or without a valid smaller layout)
    every node's agent is stopped: no restart, no training, one clear line per rank."""
    args = TINY + ["--global-batch-size", "8", "--train-iters", "4"] + reft("arc", None) + [
        "--reft-inject-health-failure", "1"]
    with launcher(2, 1, args, tmp_path, min_nodes=min_nodes) as L:
        L.start()
        codes = L.wait(180)  # a net for a stuck job: 8 s alone, 50 s on a shared host
        out = L.outputs()
        bad = status.read(L.cfg.shm_dir, L.job_id, 1)
        stops = events(L).of("health_stop")
        L.cleanup_shm()
    assert "[FAULT] node 1 (rank 1) made to fail the matmul health check on attempt 0" in out
    # every rank (one per node) stops with the one reason, naming node 1
    assert sorted(e["rank"] for e in stops) == [0, 1], (stops, out[-4000:])
    assert all(e["nodes"] == [1] and e["reason"].startswith(expect) for e in stops), stops
    assert all(c != 0 for c in codes.values()) and not re.search(r"iteration\s+1/", out)
    assert out.count("made to fail") == 1   # stopped, not restarted
    assert bad["state"] == "UNHEALTHY"
