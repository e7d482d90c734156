"""The project's sbatch scripts on a real Slurm: munged, slurmctld and four slurmd on this
host (tools/local_slurm.py), the scripts submitted unmodified with the real sbatch, nodes
lost from outside (every process of the node's job step SIGKILLed, its shared memory
wiped), in both restart modes; every run compared bit for bit with the failure-free run
(losses, state hashes, the final persistent checkpoint item by item). Where Slurm cannot
run (not installed, not root) these tests skip with the reason; `make test` installs it.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass

import pytest

from reft_ext.cluster import groups
from tests.harness import events as ev
from tests.harness.oracle import assert_same_checkpoint, assert_same_losses
from tests.harness.run import ENV_PATH, REPO, RunResult, events_file, parse

from tools import local_slurm

TINY_CPU = os.path.join(REPO, "examples", "slurm", "tiny_cpu.sbatch")
NODES = 4  # 2 training nodes and up to 2 spare nodes
# the job's numbers: the reference and every faulted run share them
EXTRA = "--log-params-hash --log-loss-history"
BASE = {"TRAIN_ARGS": "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 "
                      "--lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine",
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HANG_TIMEOUT": "4",
        "SAVE_INTERVAL": "100", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running local Slurm of NODES nodes (the client environment), stopped afterwards."""
    why = local_slurm.unavailable()
    if why:
        pytest.skip(why)
    d = str(tmp_path_factory.mktemp("slurm"))
    try:
        env = local_slurm.up(d, nodes=NODES)
    except local_slurm.SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield env
    local_slurm.down(d)


@dataclass
class Job:
    job_id: str
    rc: int
    output: str
    log_dir: str
    checkpoint: str
    events_path: str

    def run(self) -> RunResult:
        res = parse(self.output, self.rc, self.events_path)
        res.checkpoint = self.checkpoint
        return res


def lose_node(job_id: str, node: str, slot: int) -> list[int]:
    """Node ``node`` is gone, with the shared memory of the slot it held."""
    return local_slurm.lose_node(job_id, node, [f"/dev/shm/reft-{job_id}-*/node{slot}"])


def sbatch(slurm, tmp_path, *options, faults=(), timeout=300, shm_left=False, **env) -> Job:
    """Submit tiny_cpu.sbatch with the real sbatch and wait for it (faults: see
    local_slurm.submit); then nothing of the job may be left running or in /dev/shm."""
    submit = tmp_path / "submit"
    os.makedirs(submit / "logs", exist_ok=True)
    ckpt = str(tmp_path / "ckpt")
    events = events_file(str(tmp_path))
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full.update(slurm, REPO=REPO, VENV=os.path.dirname(os.path.dirname(sys.executable)),
                CKPT_DIR=ckpt, **ENV_PATH, **BASE)
    full[ev.ENV] = events
    full.update(env)
    job_id, _, out_path = local_slurm.submit(full, TINY_CPU, str(submit), options, faults,
                                             timeout)
    with open(out_path, errors="replace") as f:
        output = f.read()
    left = local_slurm.job_processes(job_id)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    shm = glob.glob(f"/dev/shm/reft-{job_id}-*")
    for p in shm:
        shutil.rmtree(p, ignore_errors=True)
    assert not left, f"job {job_id} left processes behind: {left}\n{output[-3000:]}"
    assert shm_left or not shm, f"job {job_id} left shared memory behind: {shm}"
    m = re.search(r"\[reft_job\] job \d+: exit (\d+)", output)
    return Job(job_id, int(m.group(1)) if m else 1, output,
               str(submit / "logs" / f"reft-tiny-cpu-{job_id}"), ckpt, events)


def assert_bit_exact(job: Job, ref: Job) -> None:
    assert job.rc == 0, job.output[-6000:]
    run, want = job.run(), ref.run()
    assert max(run.losses) == 10 and run.hashes == want.hashes, (run.hashes, want.hashes)
    assert_same_losses(run, want)
    assert_same_checkpoint(run, want)


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory) -> Job:
    """The failure-free job (in-process mode, no spare): what every faulted run must equal."""
    job = sbatch(slurm, tmp_path_factory.mktemp("ref"), EXTRA_ARGS=EXTRA, SPARE_WORKERS="0")
    assert job.rc == 0, job.output[-6000:]
    assert "restart in-process" in job.output
    # REFT's job id: the Slurm job's with the batch script's secret nonce (reft_job.sh)
    assert re.search(r"\[inprocess\] job %s-[0-9a-f]{16}: exit 0 after 0 restart\(s\)"
                     % job.job_id, job.output), job.output[-3000:]
    return job


def _pids_of(run: RunResult, event: str) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for e in run.events_of(event):
        out.setdefault(e["rank"], set()).add(e["pid"])
    return out


def test_in_process_frozen_rank_then_lost_node(slurm, reference, tmp_path):
    """3 nodes (one spare). Rank 0 freezes (SIGSTOP) at iteration 3: its node's watcher
    kills it after --reft-hang-timeout, a warm worker of the same node takes rank 0, and
    rank 1 restarts in its own process. In the next generation rank 1 freezes at iteration
    7 and its node is lost from outside: the spare node's warm worker takes rank 1 from
    the ARC replica, and rank 0 (the replacement of the first fault) stays in its process.
    The job ends bit-identical to the failure-free job."""
    job = sbatch(slurm, tmp_path, "--nodes=3", SPARE_NODES="1",
                 EXTRA_ARGS=EXTRA + " --inject-fault 0:3:STOP,1:7:STOP::1",
                 faults=[(r"\[FAULT\] injecting SIGSTOP into rank 1 ",
                          lambda j: lose_node(j, local_slurm.node_name(2), 1))])
    out = job.output
    assert "3 node(s) allocated, training on 2:2 x 1 ranks, 1 hot spare(s)" in out
    assert re.search(r"\[REFT\] hang: rank 0 ", out), out[-6000:]
    assert re.search(r"generation 1: rank\(s\) \[0\] replaced by worker\(s\) \['0\.1'\] "
                     r"\(1 warm", out), out[-6000:]
    assert "node reftnode2 (node 1) lost" in out
    assert "slot 1 (ranks 1-1) moves to spare node reftnode3" in out
    assert re.search(r"generation 2: rank\(s\) \[1\] replaced by worker\(s\) \['2\.0'\] "
                     r"\(1 warm", out), out[-6000:]
    run = job.run()
    restarts = _pids_of(run, "inprocess_restart")
    aborts = _pids_of(run, "inprocess_abort")
    # each survivor restarted in the process it had when its generation failed
    assert restarts[1] == aborts[1] and len(restarts[1]) == 1, (restarts, aborts)
    assert restarts[0] == aborts[0] and len(restarts[0]) == 1, (restarts, aborts)
    if groups.native() is not None:  # across nodes too: the same groups, reconfigured
        assert all(e["reconfigured"] > 0 and e["rebound"] == 0
                   for e in run.events_of("inprocess_restart")), run.events_of(
                       "inprocess_restart")
    assert "2: [REFT] recovered iteration 6 on rank 1 from ARC replica" in out
    assert "0: [REFT] recovered iteration 6 on rank 0 from own memory" in out
    assert_bit_exact(job, reference)


def _lose_at(node: int, iteration: int):
    """The fault of a test: when rank 1 stops at ``iteration``, node ``node`` is lost."""
    return (rf"\[FAULT\] injecting SIGSTOP into rank 1 \(pid \d+\) at iteration {iteration},",
            lambda j: lose_node(j, local_slurm.node_name(node), 1))


def test_torchrun_restart_lost_node(slurm, reference, tmp_path):
    """RESTART=torchrun, the other mode: node 2 is lost from outside once iteration 3 is
    logged (wherever in an iteration that lands); torchrun's rendezvous takes the spare
    node's agent in, every rank restarts as a new process, rank 1 comes back from the
    ARC replica; bit-identical to the failure-free job. (No --inject-fault: a fresh
    agent's workers count attempts from 0 and would fire it again.)"""
    job = sbatch(slurm, tmp_path, "--nodes=3", SPARE_NODES="1", RESTART="torchrun",
                 RDZV_CONF="keep_alive_interval=1,keep_alive_max_attempt=3",
                 EXTRA_ARGS=EXTRA, faults=[(r"iteration +3/ +10 \|", lambda j: lose_node(
                     j, local_slurm.node_name(2), 1))])
    out = job.output
    assert "restart torchrun" in out and "[inprocess]" not in out
    assert re.search(r"\d: \[REFT\] recovered iteration \d+ on rank 1 from ARC replica",
                     out), out[-6000:]
    assert_bit_exact(job, reference)


@pytest.mark.slow  # the default tier loses one node in each mode
def test_in_process_two_successive_node_losses(slurm, reference, tmp_path):
    """4 nodes, two of them spares: node 2 is lost at iteration 4, then the spare that
    took its ranks (node 3) at iteration 8; node 4 takes them the second time. Rank 0
    keeps its one process through both."""
    job = sbatch(slurm, tmp_path, "--nodes=4", SPARE_NODES="2",
                 EXTRA_ARGS=EXTRA + " --inject-fault 1:4:STOP,1:8:STOP::1",
                 faults=[_lose_at(2, 4), _lose_at(3, 8)])
    out = job.output
    assert "slot 1 (ranks 1-1) moves to spare node reftnode3" in out
    assert "slot 1 (ranks 1-1) moves to spare node reftnode4" in out
    run = job.run()
    assert len({e["pid"] for e in run.events_of("inprocess_restart", rank=0)}) == 1
    assert len(run.events_of("inprocess_restart", rank=0)) == 2
    assert_bit_exact(job, reference)


@pytest.mark.slow
def test_in_process_rank_frozen_during_the_abort_is_killed_by_its_node_agent(
        slurm, reference, tmp_path):
    """Rank 0 crashes at iteration 5 while rank 1 freezes (SIGSTOP) there, with REFT's
    hang detection far away (120 s): rank 1 never leaves the failed generation, so after
    ABORT_TIMEOUT the coordinator has its node's agent kill it; both ranks are replaced
    by warm workers of their own nodes and restored from their nodes' memory; exact."""
    job = sbatch(slurm, tmp_path, HANG_TIMEOUT="120", ABORT_TIMEOUT="5",
                 EXTRA_ARGS=EXTRA + " --inject-fault 0:5,1:5:STOP")
    out = job.output
    assert re.search(r"killing worker 1\.0 \(pid \d+\) with signal 9, as the coordinator "
                     r"asked", out), out[-6000:]
    assert re.search(r"generation 1: rank\(s\) \[0, 1\] replaced by worker\(s\) "
                     r"\['0\.1', '1\.1'\]", out), out[-6000:]
    assert "node reftnode2 (node 1) lost" not in out  # it answered the ping
    assert "recovered iteration 4 on rank 1 from own memory" in out
    assert_bit_exact(job, reference)


@pytest.mark.slow
def test_in_process_losing_the_stores_node_ends_the_job_cleanly(slurm, tmp_path):
    """The coordinator's store lives with the batch step on the first node. Losing that
    node ends the job (Slurm's batch host is gone) as a failure, and nothing of it keeps
    running on any node: Slurm kills every step (REFT's watchers too, so nothing is
    flushed, and the other nodes' /dev/shm segments stay until an Epilog cleans them:
    docs/nodes.md). Resubmitted, the job resumes from the persistent checkpoint."""
    job = sbatch(slurm, tmp_path, "--nodes=3", SPARE_NODES="1", shm_left=True,
                 EXTRA_ARGS=EXTRA + " --inject-fault 0:5:STOP",
                 faults=[(r"\[FAULT\] injecting SIGSTOP into rank 0 ",
                          lambda j: lose_node(j, local_slurm.node_name(1), 0))])
    assert job.rc != 0 and "training completed" not in job.output, job.output[-4000:]


@pytest.mark.slow  # the default tier: test_straggler_swap.py on one host
def test_in_process_slow_node_is_swapped_for_the_spare_node(slurm, reference, tmp_path):
    """3 nodes, one a spare: rank 1 (node 2) is made 4x slower from iteration 2. It is
    named, the job agrees on swapping its node, and right after a committed snapshot its
    rank leaves for the spare node's warm worker, which restores the committed iteration
    (from its slot's shared memory: the nodes of this Slurm share one host's /dev/shm; on
    a cluster from its peer's ARC replica, as test_in_process_frozen_rank_then_lost_node
    shows); rank 0 stays in its process; the slow node is never used again; exact."""
    job = sbatch(slurm, tmp_path, "--nodes=3", SPARE_NODES="1",
                 EXTRA_ARGS=EXTRA + " --reft-straggler-interval 2 --reft-straggler-window 2"
                                    " --reft-straggler-threshold 2 --reft-replace-stragglers"
                                    " --inject-fault 1:2:CONT:slow:4")
    out = job.output
    assert "[FAULT] slowing rank 1 (pid" in out
    assert re.search(r"\[REFT\] straggler swap: node 1 \(rank 1", out), out[-6000:]
    assert "slot 1 (ranks 1-1) moves to spare node reftnode3" in out, out[-6000:]
    assert re.search(r"generation 1: rank\(s\) \[1\] replaced by worker\(s\) \['2\.\d'\] "
                     r"\(1 warm; straggler swap", out), out[-6000:]
    run = job.run()
    (swap,) = run.events_of("straggler_swap")
    assert len({e["pid"] for e in run.events_of("inprocess_restart", rank=0)}) == 1
    assert re.search(rf"2: \[REFT\] recovered iteration {swap['iteration']} on rank 1 "
                     rf"from (own memory|ARC replica)", out), out[-6000:]
    assert not [e for e in run.events_of("straggler") if e["iteration"] > swap["iteration"]]
    assert_bit_exact(job, reference)
