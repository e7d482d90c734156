"""The coordinator's side of the multi-node in-process restart against a real node agent
process (reft_ext/cluster/node_agent.py) and a real store, without Slurm: registration,
a ping answered by a live agent and not by a frozen one (a lost node in about a second),
and a peer of the store that forges a command or bumps the event counter, which must
neither make the agent skip the coordinator's command nor hang the coordinator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from reft_ext.cluster.inprocess import ENV_SECRET, key, new_secret
from reft_ext.cluster.node_pool import NodePool
from reft_ext.cluster.supervisor import listen
from tests.harness.run import REPO

SCRIPT = "import time; time.sleep(600)\n"  # what a worker would run once assigned


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A store, a NodePool of one node and that node's agent (one worker, no preload)."""
    secret = new_secret()
    monkeypatch.setenv(ENV_SECRET, secret)
    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, **{ENV_SECRET: secret})
    proc = subprocess.Popen([sys.executable, "-m", "reft_ext.cluster.node_agent", "--store",
                             f"127.0.0.1:{store.port}", "--node", "0", "--host", "n0",
                             "--workers", "1", "--world-size", "1", "--ranks-per-node", "1",
                             "--job-id", "pool-test", "--preload", "", "--", str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    pool = NodePool(1, 1, 1, 0, register_timeout=60)
    pool.say = lambda msg: said.append(msg)
    said: list[str] = []
    try:
        pool.start(store, "127.0.0.1", store.port, secret)
        yield pool, proc, store, said
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _until(cond, timeout: float, pool) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        pool.update(0.05)
    return time.monotonic() - t0


def test_ping_tells_a_live_node_from_a_frozen_one(agent):
    pool, proc, store, said = agent
    node = pool.nodes[0]
    assert "1 node(s) registered" in said[0]
    pool.ping(node)  # alive: it beats at once, the ping is answered
    _until(lambda: node.pinged is None, 5, pool)
    assert not node.lost
    os.kill(proc.pid, signal.SIGSTOP)  # the agent freezes (its node is gone)
    try:
        time.sleep(0.3)  # its last beat is older than the ping now
        pool.ping(node)
        took = _until(lambda: node.lost, 5, pool)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert took < 2.5, took  # a ping's second, not the 3 s heartbeat timeout
    assert any("no answer to a ping" in m for m in said), said
    # a node given up is told to stop: should it be alive after all, its workers end
    proc.wait(timeout=20)
    assert "stopping the workers, as the coordinator asked" in proc.stdout.read()


def test_forged_command_and_event_counter_neither_skip_nor_hang(agent):
    pool, proc, store, said = agent
    # the next command index, written first by someone without the secret
    store.set(key("cmd", 0, 1), '{"g": 1, "v": "{\\"op\\": \\"spawn\\", \\"count\\": 50}", '
                                '"t": "00"}')
    store.add(key("evseq"), 10**6)  # and a counter far ahead of any event
    t0 = time.monotonic()
    pool.update(0.05)  # reads what exists, does not wait for a million keys
    assert time.monotonic() - t0 < 5
    time.sleep(0.5)
    pool.command(0, op="stop")  # index 1: overwrites the forged value; the agent obeys
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"unsigned/forged store value for {key('cmd', 0, 1)} ignored" in out, out
    assert "stopping the workers, as the coordinator asked" in out
    assert out.count("exited with") == 0  # no 50 workers were ever spawned
