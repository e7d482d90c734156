"""In-process restart where jobs fail most, at the start (issue 49): a kill before the
first snapshot, during the data build, during REFT's session start, of the replacement
during its rejoin, two kills within a second, and a start-up frozen with nobody to notice.
Real rank processes under the in-process launcher with a warm spare, real SIGKILLs and
SIGSTOPs, real gloo; each run ends bit-identical to the failure-free run (the state hash,
every loss, the final checkpoints by tools/compare_checkpoints.py) and no generation
waits out a collective's timeout: every start-up collective is entered by every rank or
by none (megatron/training/training.py _agree_start, docs/nodes.md's audit)."""

from __future__ import annotations

import re
import tempfile
import time

import pytest

from tests.harness import events as ev
from tests.harness.compare import same_state
from tests.harness.oracle import with_final_checkpoint
from tests.harness.recovery import reft
from tests.harness.run import TINY, events_file, parse

from tools.inprocess_launcher import InProcessLauncher
from tools.launch_nodes import LaunchConfig

ITERS = 4
HANG_S = 5  # --reft-hang-timeout: the supervisor aborts a start-up silent for twice this
# the job: two single-rank nodes, data-parallel; the failure-free run under
# torchrun is the reference (REFT does not change the numbers)
REF = [*TINY, "--train-iters", str(ITERS), "--global-batch-size", "8"]
ARGS = [*REF, *reft("arc", ranks_per_node=1), "--reft-hang-timeout", str(HANG_S),
        # a collective that waited it out would fail the test (no "Timed out waiting")
        "--distributed-timeout-minutes", "2"]


def launch(tmp_path, faults: str = "", spares: int = 1, max_restarts: int = 3):
    cfg = LaunchConfig(nnodes=2, nproc_per_node=1, restart="in-process", spares=spares,
                       max_restarts=max_restarts,
                       log_dir=tempfile.mkdtemp(dir=tmp_path, prefix="logs-"))
    args, ckpt = with_final_checkpoint([*ARGS, *(["--inject-fault", faults] if faults
                                                 else [])])
    L = InProcessLauncher(cfg, args, env={ev.ENV: events_file(str(tmp_path))})
    L.events_path, L.final_checkpoint = L.sup.cfg.env[ev.ENV], ckpt
    return L.start()


def finish(L, timeout: float = 800):
    codes = L.wait(timeout)
    run = parse(L.outputs(), max(codes.values()), L.events_path)
    run.checkpoint, run.history = L.final_checkpoint, list(L.history)
    return run


def assert_recovered_exactly(run, ref) -> None:
    """Finished, no collective waited out its timeout, bit-identical to the reference."""
    assert run.returncode == 0, run.output[-6000:]
    assert "Timed out waiting" not in run.output, run.output[-6000:]
    assert max(run.losses) == ITERS
    same_state(run, ref)


def in_process(run, rank: int) -> list[dict]:
    """The generations rank ``rank`` restarted into without leaving its process."""
    return run.events_of("inprocess_restart", rank=rank)


@pytest.mark.timeout(900)
def test_kill_in_iteration_1_before_any_snapshot(tmp_path, reference_runs):
    """The issue's job: rank 1 dies in iteration 1, nothing committed yet. Rank 0 has
    begun its optimizer step (its state is no longer the fresh one) and the warm spare
    has none at all: the agreement of generation 1 sends rank 0 to a new process and the
    replacement on in its own, instead of the two waiting in different collectives (the
    survivor kept the run id it named; the replacement had none)."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, "1:1") as L:
        run = finish(L)
    assert re.search(r"\[FAULT\] injecting SIGKILL into rank 1 .* iteration 1, phase step",
                     run.output)
    assert run.history[0]["dead"] == [1] and run.history[0]["warm"] == [True]
    assert "no state to roll back to (no snapshot committed yet, no --load)" in run.output
    assert_recovered_exactly(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_during_the_data_build_restarts_in_process(tmp_path, reference_runs):
    """Rank 1 dies as the datasets are built; rank 0 gets megatron-core's
    ``MockGPTDataset failed to build`` around gloo's error from its barrier, a peer's
    failure (reft_ext/cluster/failures.py): it restarts in its own process, its state
    still the fresh start's, beside the warm spare."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, "1:0@data") as L:
        pid0 = L.sup.pids()[0]
        run = finish(L)
    assert re.search(r"\[FAULT\] injecting SIGKILL into rank 1 .* iteration 0, phase data",
                     run.output)
    abort = run.events_of("inprocess_abort", rank=0, generation=0)
    assert abort and abort[0]["pid"] == pid0, run.events.names()
    assert [(e["generation"], e["pid"]) for e in in_process(run, 0)] == [(1, pid0)]
    assert_recovered_exactly(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_during_reft_on_start_restarts_in_process(tmp_path, reference_runs):
    """Rank 1 dies as REFT's session starts (its on_start); rank 0, in the session
    start's collectives, restarts in process."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, "1:0@on-start") as L:
        pid0 = L.sup.pids()[0]
        run = finish(L)
    assert re.search(r"injecting SIGKILL into rank 1 .* iteration 0, phase on-start",
                     run.output)
    assert [(e["generation"], e["pid"]) for e in in_process(run, 0)] == [(1, pid0)]
    assert_recovered_exactly(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_of_the_replacement_during_its_rejoin(tmp_path, reference_runs):
    """Rank 1 dies before its step of iteration 3 (iteration 2 committed); its
    replacement dies in generation 1 inside the rejoin (after REFT-load, before the
    agreement). Rank 0 goes through both generations in its process; the second
    replacement restores iteration 2 from its peers."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, "1:3,1:2:KILL::1@join", spares=2) as L:
        pid0 = L.sup.pids()[0]
        run = finish(L)
    assert re.search(r"injecting SIGKILL into rank 1 .* iteration 2, phase join", run.output)
    assert [h["dead"] for h in run.history] == [[1], [1]]
    assert [(e["generation"], e["iteration"], e["pid"]) for e in in_process(run, 0)] == \
        [(2, 2, pid0)]
    assert_recovered_exactly(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_kills_within_one_second(tmp_path, reference_runs):
    """Rank 1 and, half a second later, rank 0 are SIGKILLed from outside once iteration
    2 is logged: the second kill lands in the first one's recovery (or right before it).
    Both ranks are replaced from the spares and restore from their nodes' memory."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, spares=2, max_restarts=4) as L:
        L.wait_for(r"iteration\s+2/", timeout=240)
        L.sup.kill_rank(1)
        time.sleep(0.5)
        L.sup.kill_rank(0)
        run = finish(L)
    dead = sorted(r for h in run.history for r in h["dead"])
    assert set(dead) == {0, 1}, run.history
    assert_recovered_exactly(run, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_frozen_start_up_is_aborted_by_the_supervisor(tmp_path, reference_runs):
    """Rank 1 is stopped (SIGSTOP) as the datasets are built: nothing fails, rank 0 waits
    in megatron-core's barrier, neither uses CPU. The supervisor's start-up watch aborts
    the generation after 2 x --reft-hang-timeout, kills the stopped rank (it cannot abort
    itself), and the job goes on, rank 0 in its own process, instead of waiting for the
    distributed timeout."""
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, "1:0:STOP@data") as L:
        pid0 = L.sup.pids()[0]
        run = finish(L)
    assert re.search(r"injecting SIGSTOP into rank 1 .* iteration 0, phase data", run.output)
    h = run.history[0]
    assert h["how"] == "its start-up stalled" and h["dead"] == [1], run.history
    assert re.search(r"generation 0's start-up made no progress for \d+ s .*rank\(s\) \[1\] "
                     r"stopped", h["reason"]), h
    assert [(e["generation"], e["pid"]) for e in in_process(run, 0)] == [(1, pid0)]
    assert_recovered_exactly(run, ref)
