"""A busy node is not a hung or failed one. Beside busy loops, two per CPU (conftest's
``cpu_hog``: the load of other jobs sharing the cores, which slows every process of a
job several times), the start-up health check, hang detection and a recovery must end
exactly as on an idle host (slow tier), and the hang monitor must not count the time a
rank waited for a CPU.

What went wrong under load: the rank-0 agent picked its workers' MASTER_PORT from the
kernel's ephemeral range and the rank-0 worker bound it only after its imports, tens of
seconds later on a busy host; another job's listener or connection took it in between
(EADDRINUSE), torchrun restarted the attempt and a fault meant for attempt 0 never fired.
tools/launch_nodes.py now reserves the port (free_port); the first two tests below are
the cheap checks of that reservation, in the default tier.
"""

import fcntl
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.harness import events as ev
from tests.harness import scenarios
from reft_ext.cluster import heartbeat
from reft_ext.cluster import status
from reft_ext.cluster import watcher
from reft_ext.store.paths import node_dir

from tools import launch_nodes


def test_worker_port_is_reserved_until_bound():
    """Outside the ephemeral range (nobody's bind to port 0 or outgoing connection can
    take it), free now on every address, and locked against every other launcher."""
    lo, hi = launch_nodes._ephemeral_range()
    ports = [launch_nodes.free_port() for _ in range(8)]
    assert len(set(ports)) == 8
    for p in ports:
        assert not lo <= p <= hi and p >= launch_nodes.PORT_FLOOR, (p, lo, hi)
        assert p not in launch_nodes.TORCH_DEFAULT_PORTS
        # another open file description = another launcher: its flock fails
        fd = os.open(os.path.join(launch_nodes.PORT_LOCK_DIR, f"{p}.lock"), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert launch_nodes._bindable(ports[0])


def test_agents_pick_the_workers_port_so(tmp_path, monkeypatch):
    """The launcher's agents run torchrun with its MASTER_PORT pick replaced: torch's own
    RendezvousStoreInfo.build (the rank-0 agent's pick) returns a reserved port."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import api

    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # torch's, back afterwards
    launch_nodes.reserve_worker_ports()
    info = api.RendezvousStoreInfo.build(0, HashStore(), local_addr="127.0.1.10")
    lo, hi = launch_nodes._ephemeral_range()
    assert not lo <= info.master_port <= hi and info.master_addr == "127.0.1.10"
    cfg = launch_nodes.LaunchConfig(nnodes=2, log_dir=str(tmp_path))
    cmd = launch_nodes.NodeLauncher(cfg, [])._command(0)
    assert cmd[1] == "-c" and "nodes.reserve_worker_ports(); import torch.distributed.run" \
        in cmd[2], cmd


# ---- the real jobs beside the hog (each is a test of the default or slow tier) ----------
@pytest.mark.slow
def test_health_check_stops_the_job_under_load(cpu_hog, tmp_path):
    """The job of the reported failure: its first attempt must be the one that fails the
    check (the [FAULT] line of attempt 0), not one ended by anything else."""
    scenarios.failed_node_stops_a_job_that_cannot_shrink(*scenarios.CANNOT_SHRINK[0], tmp_path)


@pytest.mark.slow
def test_frozen_rank_is_killed_under_load(cpu_hog, tmp_path, reference_runs):
    """Only the frozen rank is named, T seconds after it froze, and the job recovers
    bit-identical: the busy ranks around it are not blamed."""
    scenarios.frozen_rank_is_killed_and_the_job_recovers(tmp_path, reference_runs)


@pytest.mark.slow
def test_stopped_rank_is_killed_at_the_timeout_under_load(cpu_hog, tmp_path):
    """A stopped rank waits for no CPU: the discount does not delay its detection."""
    scenarios.watcher_kills_a_stopped_rank_not_its_waiting_peer(tmp_path)


@pytest.mark.slow
def test_node_loss_and_replacement_under_load(cpu_hog, tmp_path, reference_runs):
    """A node lost and replaced (a new agent, a new rendezvous round, REFT-load from the
    peers' ARC replicas) ends bit-identical to the failure-free run."""
    scenarios.node_loss_and_replacement("arc", "tp2dp2", tmp_path, reference_runs)


# ---- the hang monitor on a busy host: real processes, the real watcher -----------------
_RANK = textwrap.dedent("""
    import os, sys, time
    from reft_ext.cluster.heartbeat import Heartbeat
    hb = Heartbeat({node_dir!r}, {rank}, iteration=6)
    hb.iteration_done(7)
    hb.work()
    print("ready", flush=True)
    if {spin}:  # a compute hang: busy, and never a beat again
        while True:
            pass
    # the busy loops get the CPUs first, the phase waits most of its time: nice 19, and
    # the same for its own autogroup (the kernel shares CPUs out between sessions first)
    os.setsid()
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroups here: the nice value alone does it
        pass
    t0, c0 = time.monotonic(), time.process_time()
    while time.monotonic() - t0 < {phase_s}:  # computing all along, silent for phase_s
        pass
    hb.work()
    print(f"phase {{time.monotonic() - t0:.2f}} s, {{time.process_time() - c0:.2f}} s of CPU",
          flush=True)
    hb.iteration_done(8)
""")


def _rank(node_dir, rank, spin, phase_s=0.0):
    p = subprocess.Popen([sys.executable, "-c", _RANK.format(
        node_dir=node_dir, rank=rank, spin=spin, phase_s=phase_s)],
        stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.slow
def test_starved_rank_is_not_hung_a_spinning_one_is(cpu_hog, tmp_path):
    """Timeout 1 s. Rank 0 computes for 4 s between two beats but, at nice 19 beside the
    busy loops, gets less than half a second of CPU in them: busy, not hung, never killed.
    Rank 1 spins without a beat: it gets the CPU time to show progress and shows none, so
    it is killed, with the time it waited for a CPU said and not counted."""
    d, job, T = str(tmp_path), "load", 1.0
    dirs = [node_dir(d, job, n) for n in (0, 1)]
    for x in dirs:
        os.makedirs(x)
    busy, spin = _rank(dirs[0], 0, False, phase_s=4 * T), _rank(dirs[1], 1, True)
    try:
        last_beat = heartbeat.read(heartbeat.path(dirs[1], 1))["t"]  # time.monotonic()
        with scenarios.events_env(tmp_path) as events:
            watcher.spawn(d, job, 0, [busy.pid], "", ranks=[0], hang_timeout=T)
            watcher.spawn(d, job, 1, [spin.pid], "", ranks=[1], hang_timeout=T)
        assert spin.wait(timeout=60) == -signal.SIGKILL
        silent_until_killed = time.monotonic() - last_beat
        out, _ = busy.communicate(timeout=120)
        # finished, not SIGKILLed
        assert busy.returncode == 0, (busy.returncode, ev.load(events))
    finally:
        for p in (busy, spin):
            p.kill()
            p.wait()
    wall, cpu = map(float, re.search(r"phase ([0-9.]+) s, ([0-9.]+) s of CPU", out).groups())
    assert wall >= 4 * T and cpu < T / 2, f"{out}: the host was not busy, nothing shown"
    assert silent_until_killed >= T, silent_until_killed  # not killed before its limit
    assert status.wait_watchers(d, job, 20)
    hang = ev.load(events).one("hang")  # rank 1's, not rank 0's
    assert (hang["rank"], hang["pid"], hang["node"], hang["state"], hang["iteration"]) == \
        (1, spin.pid, 1, "computing", 7), hang
    # the time it waited for a CPU was said (the line says it from 0.05 s) and not counted
    starved, silent = hang["starved_s"], hang["silent_s"]
    # (judged at its limit, the wait discounted: not before; how soon after is scheduling)
    assert starved >= 0.05 and silent - starved >= T - 0.15, hang  # each to 0.1 s
    # rank 0's watcher judged it to the end: its worker died (exited), no hang
    assert status.read(d, job, 0)["detail"].startswith(f"worker(s) [{busy.pid}] died")
