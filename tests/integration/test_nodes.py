"""Multi-node on one host: real torchrun agents (tools/launch_nodes.py), a node lost as a
whole (agent process group SIGKILLed, its shared memory removed) and replaced by a new
agent with empty memory. Every run must end bit-identical (state hash of every rank, every
loss after the recovery) to the failure-free run, and the fault must really have fired."""

import re

import pytest

from tests.harness.run import TINY
from tests.harness.nodes import finish, launcher, stop_then_lose
from tests.integration.test_reft_recovery import _same_as_reference

N = ["--train-iters", "6"]
# 2 nodes x 2 ranks: TP pairs inside a node, sharding groups [0, 2] [1, 3] across nodes
TP2DP2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"]
ZERO1 = TP2DP2 + ["--use-distributed-optimizer"]
# 4 nodes x 1 rank: sharding groups [0, 1] [2, 3]
PP2DP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]


def reft(protect):
    return ["--reft-snapshot-every", "1", "--reft-protect", protect]


@pytest.mark.parametrize("protect,layout", [
    ("arc", TP2DP2), pytest.param("aec,aor", ZERO1, marks=pytest.mark.slow)])
def test_node_loss_and_replacement(protect, layout, tmp_path, reference_runs):
    """Node 1 (ranks 2, 3) is lost at iteration 4 and replaced: its slices come back from
    its peers' redundancy (and its ZeRO-1 shards from their AOR replicas)."""
    key = "nodes-" + ("zero1" if layout is ZERO1 else "tp2dp2")
    ref = reference_runs(key, 4, TINY + N + layout)
    with launcher(2, 2, TINY + N + layout + reft(protect) +
                  ["--inject-fault", "2:4:STOP"], tmp_path) as L:
        L.start()
        stop_then_lose(L, rank=2, nodes=[1])
        run = finish(L).check()
    out = run.output
    assert "[FAULT] injecting SIGSTOP into rank 2" in out
    source = "ARC replica" if protect == "arc" else (
        "AEC parity, optimizer shard from the AOR replica on rank {}")
    for rank, holder in ((2, 0), (3, 1)):
        assert f"[REFT] recovered iteration 3 on rank {rank} from " \
               f"{source.format(holder)}" in out, out[-3000:]
    for rank in (0, 1):
        assert f"[REFT] recovered iteration 3 on rank {rank} from own memory" in out
    _same_as_reference(run, ref, 4)


@pytest.mark.slow
def test_two_node_losses_in_one_group_fall_back_to_persistent(tmp_path, reference_runs):
    """Nodes 0 and 1 (the whole sharding group [0, 1]) are lost together at iteration 5:
    arc cannot rebuild two slices of one group, the log says so, and the job resumes from
    the persistent checkpoint of iteration 4 (the work since it is redone)."""
    ref = reference_runs("pp2dp2", 4, TINY + N + PP2DP2)
    save = str(tmp_path / "ckpt")
    with launcher(4, 1, TINY + N + PP2DP2 + reft("arc") + [
            "--save", save, "--load", save, "--save-interval", "2",
            "--inject-fault", "0:5:STOP"], tmp_path) as L:
        L.start()
        stop_then_lose(L, rank=0, nodes=[0, 1])
        run = finish(L).check()
    out = run.output
    assert "[REFT] recovery from host memory not possible: iteration 4: sharding group " \
           "[0, 1] lost the slices of ranks [0, 1], more than --reft-protect arc can " \
           "rebuild" in out
    assert f"[REFT] recovered iteration 4 from the persistent checkpoint {save}" in out
    _same_as_reference(run, ref, 5)


DP2 = ["--global-batch-size", "8"]


def test_sigterm_flushes_and_a_fresh_job_resumes_from_it(tmp_path, reference_runs):
    """Preemption: SIGTERM to every agent mid-run. Each node's watcher flushes the node's
    committed snapshots to <--save>/reft-flush; the job is restarted from scratch (empty
    /dev/shm, a new rendezvous id) and resumes from the flushed state with no completed
    iteration lost, bit-identical to the failure-free run."""
    from reft_ext.cluster import status
    from tools.reft_status import table

    n8 = ["--train-iters", "8"]
    ref = reference_runs("nodes-dp2", 2, TINY + n8 + DP2)
    save = str(tmp_path / "ckpt")
    args = TINY + n8 + DP2 + reft("arc") + ["--reft-schedule", "end-of-iteration",
                                             "--save", save, "--save-interval", "100"]
    with launcher(2, 1, args, tmp_path, job_id=f"pre-{tmp_path.name[-12:]}") as L:
        L.start()
        L.wait_for(r"iteration\s+3/", timeout=90)
        live = {r["node"]: r for r in status.read_job(L.cfg.shm_dir, L.job_id)}
        assert {live[n]["state"] for n in (0, 1)} <= {"SNAP", "COMPLETED"}
        assert min(live[n]["iteration"] for n in (0, 1)) >= 2
        L.terminate()
        out = L.outputs()
        final = status.read_job(L.cfg.shm_dir, L.job_id)
        shown = table(L.cfg.shm_dir, L.job_id)
        L.cleanup_shm()  # the new job starts on empty host memory
    logged = max(int(i) for i in re.findall(r"iteration\s+(\d+)/", out))
    # each node's newest flushed snapshot (the SIGTERM may land between the two ranks'
    # snapshots of one iteration: node 0 flushes [3, 4], node 1 [3])
    newest = {int(n): max(int(x) for x in its.split(", ")) for n, its in re.findall(
        r"\[REFT\] flushed node (\d)'s snapshots \(ranks \[\d\], iterations \[([\d, ]+)\]",
        out)}
    assert sorted(newest) == [0, 1] and min(newest.values()) >= logged, \
        (newest, logged, out[-3000:])
    assert [r["state"] for r in final] == ["UNHEALTHY", "UNHEALTHY"], final
    assert "UNHEALTHY" in shown and "flushed node 1's snapshots" in shown
    with launcher(2, 1, args + ["--load", save], tmp_path) as L2:
        run = finish(L2.start()).check()
    # each rank imports its node's newest; the job resumes the newest iteration committed
    # job-wide (an iteration one node finished alone was never committed): no completed
    # iteration lost, both ranks the same
    recovered = {int(r): int(i) for i, r in re.findall(
        r"\[REFT\] recovered iteration (\d+) on rank (\d) from own memory", run.output)}
    it = recovered.get(0)
    assert recovered == {0: it, 1: it} and logged <= it <= min(newest.values()), \
        (recovered, newest, logged)
    for r in (0, 1):
        assert (f"[REFT] rank {r}: host memory had nothing newer than the flushed snapshot "
                f"of iteration {newest[r]}") in run.output
    assert run.hashes == ref.hashes
    assert sorted(run.losses)[0] == it + 1 and max(run.losses) == 8
    assert all(run.losses[i] == ref.losses[i] for i in run.losses)
