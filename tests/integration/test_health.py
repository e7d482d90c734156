"""The start-up health check (reft_ext/cluster/health.py) and the elastic shrink.

Units: the DLRover pairing and verdict, the flags, the matmul check, the shrink decision.
Real processes: a gloo job of spawned processes runs the two-round check and names the
injected node; real torchrun agents (tools/launch_nodes.py) where a node fails the check
after a crash and the job goes on without it (fewer DP replicas, state resharded from the
persistent tier), or stops with a message naming the node and the flag."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.multiprocessing as tmp

from tests.harness.compare import same_state
from tests.harness import scenarios
from tests.harness.recovery import assert_persistent_fallback
from tests.harness.run import TINY, parse, torchrun
from tests.harness.nodes import events, launcher, wait_for_event
from reft_ext.cluster import status
from reft_ext.config import ReftConfigError
from reft_ext.cluster.health import (ALLGATHER, MATMUL, HealthReport, Failure, judge, matmul_check,
                             pair_nodes, regroup, run_health_check)
from reft_ext.cluster.health_config import HealthConfig


# ---- the pairing and the verdict (pure Python) ----------------------------------------
def test_pairs_cover_every_node_once():
    assert pair_nodes([]) == [] and pair_nodes([3]) == [(3,)]
    assert pair_nodes([0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert pair_nodes([0, 1, 2]) == [(0, 1, 2)]          # odd: a triple
    assert pair_nodes([4, 0, 1, 2, 3]) == [(0, 1), (2, 3, 4)]
    # round 2: a good node is in one group per sub-round
    assert regroup([2, 3, 4], [0, 1]) == [[(2, 0), (3, 1)], [(4, 0)]]
    assert regroup([0, 1], []) == []


def test_round_two_names_the_bad_node():
    r1 = {(0, 1): (True, ""), (2, 3): (False, "rank 3 received a wrong payload from rank 2")}
    r2 = {(2, 0): (False, "rank 0 received a wrong payload from rank 2"), (3, 1): (True, "")}
    failures, unresolved, notes = judge([0, 1, 2, 3], {}, r1, r2)
    assert [(f.node, f.check) for f in failures] == [(2, ALLGATHER)] and not unresolved
    assert "round 1 with nodes [2, 3] failed" in failures[0].reason
    assert "round 2 with node 0 failed" in failures[0].reason and not notes


def test_a_bad_link_is_not_a_bad_node():
    r1 = {(0, 1): (False, "timeout"), (2, 3): (True, "")}
    failures, unresolved, notes = judge([0, 1, 2, 3], {}, r1, {(0, 2): (True, ""),
                                                               (1, 3): (True, "")})
    assert not failures and not unresolved
    assert "nodes [0, 1] failed in round 1" in notes[0] and "the link" in notes[0]


def test_two_nodes_cannot_be_told_apart_and_matmul_fails_alone():
    _, unresolved, _ = judge([0, 1], {}, {(0, 1): (False, "x")}, {})
    assert "nodes [0, 1] failed the all-gather check" in unresolved
    assert "cannot tell which" in unresolved
    failures, unresolved, _ = judge([0, 1, 2], {1: "rank 1: max error 1"},
                                    {(0, 1, 2): (True, "")}, {})
    assert [(f.node, f.check) for f in failures] == [(1, MATMUL)] and not unresolved


def test_matmul_check_catches_a_wrong_entry():
    ok, detail, ms = matmul_check(64)
    assert ok and ms >= 0 and "max error" in detail
    ok, detail, _ = matmul_check(64, corrupt=True)
    assert not ok and "against the float64 reference" in detail


def test_flags():
    assert HealthConfig().injection is None
    assert HealthConfig(inject_health_failure="2").injection == (2, MATMUL, 0)
    assert HealthConfig(inject_health_failure="1:allgather:3").injection == (1, ALLGATHER, 3)
    for kw, flag in ((dict(inject_health_failure="x:matmul"), "--reft-inject-health-failure"),
                     (dict(inject_health_failure="1:disk"), "--reft-inject-health-failure"),
                     (dict(health_check="yes"), "--reft-health-check"),
                     (dict(health_timeout=0), "--reft-health-timeout"),
                     (dict(min_nodes=-1), "--reft-min-nodes")):
        with pytest.raises(ReftConfigError, match=flag):
            HealthConfig(**kw)
    assert HealthConfig().enabled(1) and not HealthConfig().enabled(0)
    assert HealthConfig(min_nodes=2).enabled(0) and not HealthConfig(health_check="off").enabled(1)


def _report(nodes, bad, restarts=1):
    return HealthReport(list(range(nodes)), {n: [n] for n in range(nodes)},
                        [Failure(b, MATMUL, "x") for b in bad], info=[restarts] * nodes)


@pytest.mark.parametrize("argv,restarts,expect", [
    ([], 1, "the launch is not elastic: start it with torchrun --nnodes MIN:3 and "
            "--reft-min-nodes MIN"),
    (["--reft-min-nodes", "3"], 1, "2 node(s) would remain, fewer than --reft-min-nodes 3"),
    (["--reft-min-nodes", "2"], 0, "torchrun has no restart left (--max-restarts)"),
    (["--reft-min-nodes", "2", "--global-batch-size", "6"], 1,
     "the layout cannot shrink to 2 ranks: --global-batch-size: 6 is not divisible"),
    (["--reft-min-nodes", "2"], 1, "the job goes on with 2 of 3 nodes (2 ranks, "
                                    "--reft-min-nodes 2): data-parallel size 3 -> 2"),
])
def test_shrink_decision(argv, restarts, expect, monkeypatch):
    from megatron.training.arguments import parse_args
    from megatron.training.reft_integration import shrink_plan

    monkeypatch.delenv("REFT_MIN_NODES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = parse_args(TINY + ["--global-batch-size", "12", "--reft-snapshot-every", "1",
                              "--reft-protect", "arc"] + argv, world_size=3)
    ok, why = shrink_plan(args, HealthConfig.from_args(args), _report(3, [1], restarts), 1)
    assert expect in why and ok == expect.startswith("the job goes on"), why


def test_arc_cannot_shrink_to_one_replica(monkeypatch):
    from megatron.training.arguments import parse_args
    from megatron.training.reft_integration import shrink_plan

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = parse_args(TINY + ["--reft-snapshot-every", "1", "--reft-protect", "arc",
                              "--reft-min-nodes", "1"], world_size=2)
    ok, why = shrink_plan(args, HealthConfig.from_args(args), _report(2, [0]), 1)
    assert not ok and "--reft-protect: arc needs data-parallel size >= 2" in why


def _offer(old_rank, have, protection="arc", iters=(4,)):
    return {"old_rank": old_rank, "why": "", "iters": {it: {
        "slot": 0, "old_group": [0, 1, 2], "D": 3, "slice": 64, "have": have,
        "protection": protection} for it in iters}}


def test_reshard_plan_from_the_survivors_slices():
    """Old group [0, 1, 2] (ARC), old rank 1 excluded: old rank 0 holds slices 0 and 1
    (own, replica), old rank 2 holds 2 and 0; they are new ranks 0 and 1."""
    from reft_ext.load.errors import (MissingHandover, NoRestorableIteration,
                                      PersistentIsNewer)
    from reft_ext.load.reshard import plan_reshard

    both = [_offer(0, {0: "own", 1: "redundancy"}, iters=(3, 4)),
            _offer(2, {2: "own", 0: "redundancy"}, iters=(3, 4))]
    assert plan_reshard(both, [[0, 1]], None) == (4, {0: [0, 0, 1]})
    with pytest.raises(PersistentIsNewer, match=r"^the persistent checkpoint \(iteration 6\) "
                       r"is newer than host memory \(iteration 4\)$"):
        plan_reshard(both, [[0, 1]], 6)
    with pytest.raises(NoRestorableIteration) as e:
        plan_reshard([_offer(0, {0: "own"}, "none"), _offer(2, {2: "own"}, "none")],
                     [[0, 1]], None)
    assert "the slices of old ranks [1] (sharding group [0, 1, 2]) left " \
        "with the excluded node(s) and no survivor holds a copy (--reft-protect none)" \
        in str(e.value)
    with pytest.raises(MissingHandover, match=r"^ranks \[1\] have no note of their place "
                       r"in the old job$"):
        plan_reshard([both[0], None], [[0, 1]], None)


def test_handover_note_is_read_once(tmp_path):
    from reft_ext.load.reshard import take_handover, write_handover

    path = write_handover(str(tmp_path), "j", rank=2, node=2, world_size=3)
    # the private side dir, under the job's private parent (reft-<job>/node<n>.meta)
    assert os.path.relpath(os.path.dirname(path), tmp_path) == os.path.join("reft-j", "node2.meta")
    assert os.path.basename(path).startswith("handover-")
    assert take_handover(str(tmp_path), "j") == {"rank": 2, "node": 2, "world_size": 3}
    assert take_handover(str(tmp_path), "j") is None and not os.listdir(tmp_path)


# ---- the check itself, in a real gloo job of spawned processes -------------------------
CASES = [  # (ranks per node, injected (node, check) or None, a rejoin)
    (1, None, False), (1, (2, ALLGATHER), False), (2, (1, MATMUL), False),
    (2, (0, ALLGATHER), False), (1, (1, MATMUL), False), (1, None, True),
    (2, (1, MATMUL), True)]


def _worker(rank, world, store_file, out_dir):
    from torch.distributed import distributed_c10d as c10d

    torch.distributed.init_process_group("gloo", init_method=f"file://{store_file}",
                                         rank=rank, world_size=world)
    results = []
    for rpn, inject, rejoin in CASES:
        made = c10d._world.group_count
        r = run_health_check(rank, world, rpn, matmul_size=64, timeout_s=20, inject=inject,
                             info=rank, rejoin=rejoin)
        results.append({"ok": r.ok, "bad": r.bad_nodes, "lines": r.lines(), "info": r.info,
                        "checks": [f.check for f in r.failures], "ms": 1000 * r.seconds,
                        "groups": c10d._world.group_count - made})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def test_real_check_names_the_injected_node(tmp_path):
    """4 processes: as 4 nodes x 1 rank and as 2 nodes x 2 ranks. Every rank gets the
    same verdict; round 2 tells node 2 from its partner node 3; with two nodes only an
    all-gather failure cannot be pinned on one."""
    tmp.start_processes(_worker, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4,
                        start_method="spawn")
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    for case in [i for i, c in enumerate(CASES) if c[1]]:  # the same verdict, word for word

        assert all(res[r][case]["lines"] == res[0][case]["lines"] for r in range(4))
    ok, ag, mm2, ag2, mm1, rejoin_ok, rejoin_mm2 = res[0]
    assert ok["ok"] and ok["info"] == [0, 1, 2, 3] and "4 node(s) passed" in ok["lines"][-1]
    # a rejoin of an in-process restart: no groups of its own, no pair rounds, the same
    # gathered info, and a bad matmul still named on every rank
    assert ok["groups"] >= 3 and rejoin_ok["groups"] == rejoin_mm2["groups"] == 0
    assert rejoin_ok["ok"] and rejoin_ok["info"] == [0, 1, 2, 3]
    assert "no all-gather rounds" in rejoin_ok["lines"][-1]
    assert rejoin_mm2["bad"] == [1] and rejoin_mm2["checks"] == [MATMUL]
    assert rejoin_mm2["lines"][0].startswith(
        "node 1 (ranks [2, 3]) failed the matmul check: rank 2: max error")
    # (its cost, ok["ms"], is benchmarks/bench_health.py's figure, not a verdict here)
    assert ag["bad"] == [2] and ag["checks"] == [ALLGATHER]
    assert ag["lines"][0].startswith("node 2 (ranks [2]) failed the all-gather check: "
                                     "round 1 with nodes [2, 3] failed (rank 3 received a "
                                     "wrong payload from rank 2")
    assert mm2["bad"] == [1] and mm2["lines"][0].startswith(
        "node 1 (ranks [2, 3]) failed the matmul check: rank 2: max error")
    assert not ag2["ok"] and ag2["bad"] == [] and "cannot tell which" in ag2["lines"][0]
    assert mm1["bad"] == [1] and mm1["checks"] == [MATMUL]


# ---- torchrun agents: shrink, or stop ----------------------------------------------------
GBS12 = ["--global-batch-size", "12", "--train-iters", "8"]
REFT = ["--reft-snapshot-every", "1", "--reft-protect", "arc"]


def _shrunk_reference(layout, tmp_path):
    """What the shrunk job must reproduce bit for bit: the failure-free DP-3 run up to
    iteration 4 (the state the shrink resumes from) saved to a persistent checkpoint, then
    the same job at DP 2 (same global batch) loading it and training to the end."""
    ckpt = str(tmp_path / "reference-ckpt")
    dp3 = torchrun(3, TINY + layout + ["--save", ckpt, "--exit-interval", "4"]).check()
    assert dp3.iteration == 4
    dp2 = torchrun(2, TINY + layout + ["--load", ckpt]).check()
    assert f"loaded checkpoint {ckpt}/iter_0000004" in dp2.output, dp2.output[-4000:]
    assert dp2.iteration == 8 and sorted(dp2.losses) == [5, 6, 7, 8]
    return dp2


@pytest.mark.parametrize("zero1", [
    pytest.param(False, id="memory", marks=pytest.mark.slow),
    pytest.param(True, id="persistent", marks=pytest.mark.slow)])
def test_elastic_shrink_after_a_crash(zero1, tmp_path):
    """3 nodes x 1 rank (DP 3), --min-nodes 2. Rank 0 crashes at iteration 5; on the
    restart node 1 fails its matmul check: it is named, marked UNHEALTHY and leaves; nodes
    0 and 2 re-rendezvous as a job of 2 (DP 2) and resume iteration 4: resharded from the
    survivors' host memory (their own slices and ARC replicas), or with ZeRO-1 (shards cut
    for DP 3) from the persistent checkpoint, which megatron-core reshards. The rest must
    be bit-identical to the failure-free DP-3 run resumed at DP 2 from its checkpoint of
    iteration 4 (_shrunk_reference): a reshard that loaded anything else (a reset, another
    iteration, a wrong slice, another rank's shard or RNG streams) differs there."""
    layout = GBS12 + (["--use-distributed-optimizer"] if zero1 else [])
    ref = _shrunk_reference(layout, tmp_path)
    save = str(tmp_path / "ckpt")
    args = TINY + layout + REFT + ["--save", save, "--load", save, "--save-interval", "2",
                                   "--inject-fault", "0:5",
                                   "--reft-inject-health-failure", "1:matmul:1"]
    with launcher(3, 1, args, tmp_path, min_nodes=2) as L:
        L.start()
        wait_for_event(L, "shrink", rank=1, timeout=80)  # node 1's one rank
        bad = status.read(L.cfg.shm_dir, L.job_id, 1)
        codes = L.wait(90)
        out = L.outputs()
        L.cleanup_shm()
    run = parse(out, 0)
    run.events = events(L)
    run.checkpoint = save  # its own --save holds the final checkpoint (the oracle's)
    assert "[FAULT] injecting SIGKILL into rank 0" in out
    assert "[FAULT] node 1 (rank 1) made to fail the matmul health check on attempt 1" in out
    # every rank of the job of 3 found node 1 bad, and each node's log says so
    failed = {e["rank"]: e["failures"] for e in run.events_of("health", ok=False)}
    assert sorted(failed) == [0, 1, 2], run.events_of("health")
    for failures in failed.values():
        assert [(f["node"], f["check"]) for f in failures] == [(1, "matmul")], failures
        assert failures[0]["reason"].startswith("rank 1: max error"), failures
    line = "[REFT] health: node 1 (ranks [1]) failed the matmul check: rank 1: max error"
    assert all(line in L.output(n) for n in range(3)), out[-4000:]
    shrinks = run.events_of("shrink")
    assert shrinks and all(e["nodes"] == [1] and e["reason"].startswith(
        "the job goes on with 2 of 3 nodes (2 ranks, --reft-min-nodes 2): data-parallel "
        "size 3 -> 2") for e in shrinks), shrinks
    assert bad["state"] == "UNHEALTHY" and "failed the health check" in bad["detail"]
    assert codes[0] == 0 and codes[2] == 0 and codes[1] != 0, (codes, out[-4000:])
    assert any(len(e["nodes"]) == 2 for e in run.events_of("health", ok=True))
    if zero1:
        assert any(e["reason"].startswith("ZeRO-1 ")
                   for e in run.events_of("reshard_impossible")), run.events.names()
        assert any("host memory holds snapshots of a job of 3 ranks (data-parallel size 3), "
                   "this job has 2 ranks (data-parallel size 2)" in e["reason"]
                   for e in run.events_of("recovery_impossible")), run.events.names()
        assert "from data-parallel size 3 to 2" in out
        assert_persistent_fallback(run.events, 4, save)
    else:
        for rank, old in ((0, 0), (1, 2)):
            e = run.events.one("resharded", rank=rank)
            assert (e["iteration"], e["old_rank"], e["old_group"], e["group"],
                    e["providers"]) == (4, old, [0, 1, 2], [0, 1], [0, 0, 1]), e
        assert not run.events_of("recovered_persistent")
    assert run.iteration == 8 and sorted(run.losses) == [5, 6, 7, 8]
    # new rank r is data-parallel rank r of the DP-2 job (old ranks 0 and 2, as logged
    # above), as in the reference: each rank's whole state and every later loss, exactly
    same_state(run, ref)
    assert not re.search(r"iteration\s+[1-4]/", out.split("excluding node(s) [1]")[-1])


@pytest.mark.parametrize("min_nodes,expect", scenarios.CANNOT_SHRINK)
def test_failed_node_stops_a_job_that_cannot_shrink(min_nodes, expect, tmp_path):
    scenarios.failed_node_stops_a_job_that_cannot_shrink(min_nodes, expect, tmp_path)
