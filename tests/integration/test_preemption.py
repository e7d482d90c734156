"""Preemption: SIGTERM (torchrun's default action, no --exit-signal-handler) right after
an iteration's log line. Under HAS the snapshot of that iteration is still in flight
(copied during the next one, committed before its optimizer step): the ranks finish and
commit it before they terminate, each node's watcher flushes it, and a new job on empty
host memory resumes from exactly the last completed iteration, bit-identical to the
failure-free run (README, docs/operations.md: no completed iteration lost)."""

from __future__ import annotations

import glob
import os
import shutil
import uuid

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import N, OWN, assert_recovered, reft, wait_watchers_exited
from tests.harness.run import LAYOUTS, TINY, torchrun

LAYOUT = "pp2dp2-zero1"  # shared reference run (test_fault_phases.py, test_has.py ...)
BASE = TINY + N + LAYOUTS[LAYOUT]


@pytest.mark.parametrize("ranks", [
    # slow tier (make test's budget): SIGTERM stays in the default tier through the chaos
    # campaign's "term" faults (tests/integration/test_chaos.py)
    pytest.param([0, 1, 2, 3], id="every-rank", marks=pytest.mark.slow),
    pytest.param([1], id="one-rank", marks=pytest.mark.slow)])
def test_sigterm_after_a_logged_iteration_loses_nothing(ranks, tmp_path, reference_runs):
    """SIGTERM as iteration 4 begins (iteration 3 logged, its snapshot in flight), to
    every rank (a preemption) or to one. Before the fix the watchers flushed iteration 2
    and the next job trained iteration 3 again."""
    ref = reference_runs(LAYOUT, 4, BASE)
    job = f"term-{uuid.uuid4().hex[:10]}"
    save = str(tmp_path / "ckpt")
    args = BASE + reft("arc,aor") + ["--reft-job-id", job, "--save", save]
    faults = ",".join(f"{r}:4:TERM@forward" for r in ranks)
    try:
        first = torchrun(4, args + ["--inject-fault", faults])
        assert first.returncode != 0
        assert "iteration        3/" in first.output and \
            "iteration        4/" not in first.output, first.output[-3000:]
        for r in ranks:
            assert f"[FAULT] injecting SIGTERM into rank {r} (pid" in first.output
            # the rank committed the snapshot in flight, then terminated
            assert first.events_of("sigterm_committed", rank=r, iteration=3), \
                first.events.names()
        wait_watchers_exited("/dev/shm", job, range(4))
        flushed = sorted(glob.glob(os.path.join(save, "reft-flush", "rank*.committed")))
        assert len(flushed) == 4, flushed
    finally:  # the new job starts on empty host memory (node dirs, status files)
        for p in glob.glob(os.path.join("/dev/shm", f"reft-{job}")):  # the job's parent
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    run = torchrun(4, args + ["--load", save]).check()
    assert sorted(e["rank"] for e in run.events_of("imported_flushed", iteration=3)) == \
        [0, 1, 2, 3], run.events_of("imported_flushed")
    assert_recovered(run.events, 3, {r: OWN for r in range(4)})
    same_as_reference(run, ref, 4)
