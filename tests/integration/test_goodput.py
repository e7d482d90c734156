"""Goodput accounting and straggler detection end to end: real torchrun, a rank really
slowed (``--inject-fault R:I:CONT:slow:F``), real SIGKILLs and a lost node; every rank's
categories must add up to its wall time across the restarts, and the slowed rank must be
the one named. (The default tier's crash + lost node with goodput:
test_zeropp.py's recovery test; in-process: test_inprocess.py's first test.)"""

from __future__ import annotations

import pytest

from tests.harness.goodput import assert_goodput_adds_up
from tests.harness.recovery import reft
from tests.harness.run import TINY, torchrun

DP2 = ["--global-batch-size", "4"]


def _scalars(directory: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_slowed_rank_is_named_and_the_others_wait_for_it(tmp_path):
    """Rank 1 of a DP2 job is made 4x slower from iteration 3: the exchanges every 3
    iterations name it (only it) after 2 slow windows in a row, in a [REFT] line, an
    event and TensorBoard; rank 0's goodput books the wait for it."""
    tb = str(tmp_path / "tb")
    run = torchrun(2, TINY + DP2 + [
        "--train-iters", "20", "--log-interval", "5", "--tensorboard-dir", tb,
        "--reft-straggler-interval", "3", "--reft-straggler-window", "2",
        "--inject-fault", "1:3:CONT:slow:4"]).check()
    assert "[FAULT] slowing rank 1 (pid" in run.output  # the fault really fired
    named = run.events_of("straggler")
    assert [e["rank"] for e in named] == [1], named
    assert named[0]["ratio"] > 1.5 and named[0]["cost_s"] > 0, named
    assert named[0]["iteration"] >= 6 and named[0]["exchanges"] == 2, named
    assert "[REFT] straggler: rank 1 (node 0) is " in run.output
    exchanges = run.events_of("straggler_exchange")
    assert [e["iteration"] for e in exchanges] == [3, 6, 9, 12, 15, 18], exchanges
    finals = run.events.by_rank("goodput", final=True)
    assert finals[0]["exchanges"] == 6 and finals[0]["exchange_s"] > 0
    assert finals[0]["seconds"]["straggler_wait"] > finals[1]["seconds"]["straggler_wait"]
    assert_goodput_adds_up(run, ranks=2, failures=0, attempts=1)
    assert "[REFT] stragglers cost the job " in run.output
    scalars = _scalars(tb)  # Megatron's writer, the last rank's
    assert len(scalars["goodput"]) == 4 and 0 < scalars["goodput"][-1] < 100, scalars.keys()
    assert max(scalars["stragglers/slowest-ratio"]) > 1.5
    assert scalars["stragglers/slow-ranks"][-1] == 1
    assert "goodput/straggler_wait-percent" in scalars


@pytest.mark.slow  # the default tier: test_zeropp.py's crash + lost node checks goodput
def test_goodput_of_a_crash_a_lost_node_and_a_rollback_adds_up():
    """DP2, arc: rank 1 SIGKILLed at iteration 4 (attempt 0), its node lost at 8
    (attempt 1), a NaN at 12 rolled back in process (attempt 2): three process attempts,
    two failures, one rollback, every second of every rank booked once."""
    run = torchrun(2, TINY + DP2 + reft("arc") + [
        "--train-iters", "14", "--log-interval", "2",
        "--inject-fault", "1:4,1:8:KILL:node:1", "--inject-spike", "0:12:nan"],
        max_restarts=2).check()
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert "[FAULT] wiped failure domain 1" in run.output
    assert run.events_of("rollback")
    assert_goodput_adds_up(run, ranks=2, failures=2, attempts=3)
    finals = run.events.by_rank("goodput", final=True)
    assert all(f["rollbacks"] == 1 and f["seconds"]["rollback"] > 0 for f in finals.values())
    assert all(f["iterations"] == 14 for f in finals.values()), finals


def test_goodput_carries_across_a_torchrun_restart_with_no_events_file(tmp_path):
    """issue 57 item 4: no REFT_EVENTS_FILE; rank 1 SIGKILLed at iteration 4 of 8 under
    torchrun --max-restarts 1: the restarted processes find their ranks' records in the
    job's private default file, so the job's line counts 2 attempts and 1 failure and all
    8 iterations kept; the file is gone at the normal end. The ranks exchange their phase
    times every iteration and wait in the gradient sync for each other, but nobody is
    named slow: no straggler wait is booked."""
    import glob
    import os

    run = torchrun(2, TINY + DP2 + reft("arc") + [
        "--train-iters", "8", "--log-interval", "2", "--inject-fault", "1:4",
        "--reft-straggler-interval", "1"],  # an exchange every iteration, no one slow
        max_restarts=1, env={"REFT_EVENTS_FILE": "", "TMPDIR": str(tmp_path)}).check()
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    line = [ln for ln in run.output.splitlines() if "[REFT] goodput: " in ln]
    assert len(line) == 1, run.output[-3000:]
    assert "2 process attempts, 1 failure, " in line[0] and "8 iterations kept" in line[0], line
    assert "straggler wait" not in line[0], line
    assert "planner predicts" in line[0]
    assert glob.glob(os.path.join(str(tmp_path), "reft-*", "goodput", "*.jsonl")) == []
    assert os.path.isdir(os.path.join(str(tmp_path), f"reft-{os.geteuid()}", "goodput"))
