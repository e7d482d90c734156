"""Faults at the trainer's moments (``--inject-fault RANK:ITER[...]@PHASE``, trainer
side; reft_ext/testing/fault_specs.py): a process killed, stopped or terminated
while it computes a forward or a backward pass, while it sends or receives pipeline
activations, before its optimizer step, at every step of a persistent save, during the
start-up health check, and a full /dev/shm at the next snapshot space reservation.

Real torchrun, PP2 x DP2 with ZeRO-1 (tests/harness LAYOUTS) under REFT arc,aor, or with
the persistent checkpoint alone where the save itself is what fails. Every run must end
bit-identical (state hash per rank, every later loss) to the failure-free run of the same
flags; the fault must really have fired ([FAULT] line naming the phase); nothing hangs
(torchrun's timeout); no torn checkpoint is ever loaded (the tracker moves only after
every rank wrote).

The library's own moments (commit, has-copy, load-*, aor, flush) are in
test_fault_phases_reft.py."""

from __future__ import annotations

import os
import re

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import N, reft
from tests.harness.run import LAYOUTS, TINY, torchrun

LAYOUT = "pp2dp2-zero1"  # pipeline groups [0, 2] [1, 3]: ranks 0, 1 first stage, 2, 3 last
BASE = TINY + N + LAYOUTS[LAYOUT]
REFT = reft("arc,aor")
TRACKER = "latest_checkpointed_iteration.txt"


def _reference(reference_runs):
    return reference_runs(LAYOUT, 4, BASE)  # shared with test_reft_recovery, test_has


def _fired(run, rank: int, iteration: int, phase: str, signal: str = "SIGKILL") -> str:
    """The observer's [FAULT] line of that spec (printed before the signal)."""
    pat = re.compile(rf"^\[FAULT\] injecting {signal} into rank {rank} \(pid (\d+)\) at "
                     rf"iteration {iteration}, phase {re.escape(phase)}\b", re.M)
    m = pat.search(run.output)
    assert m, (rank, iteration, phase, [ln for ln in run.output.splitlines()
                                        if "[FAULT]" in ln] or run.output[-3000:])
    return m.group(0)


def _resumed(run) -> int:
    """The iteration the last attempt resumed from: its REFT-load or its checkpoint
    load, 0 for a fresh start. The [LOSSES] line is that attempt's, from there on."""
    loads = [(e["iteration"]) for e in run.events
             if e["event"] in ("recovered", "recovered_persistent")]
    lines = re.findall(r"loaded checkpoint \S+ at iteration (\d+)", run.output)
    if not run.events.of("recovered") and lines:
        return int(lines[-1])
    return loads[-1] if loads else 0


def _assert_same(run, reference_runs) -> int:
    it = _resumed(run)
    same_as_reference(run, _reference(reference_runs), it + 1)
    return it


def _assert_tracker_whole(save: str) -> int:
    """The tracker names a checkpoint that every rank finished writing."""
    it = int(open(os.path.join(save, TRACKER)).read())
    assert os.path.isfile(os.path.join(save, f"iter_{it:07d}", "metadata.json")), it
    return it


# ---- a pass and a save (make test-all: make test's 12 minutes; the default tier kills in
# random phases in test_chaos.py and falls back to an older checkpoint in
# test_checkpoint_integrity.py) ---------------------------------------------------------
@pytest.mark.parametrize("layout,protect", [
    pytest.param("pp2dp2", "arc", marks=pytest.mark.slow),
    pytest.param(LAYOUT, "arc,aor", marks=pytest.mark.slow)])
def test_kill_in_backward_then_between_checkpoint_and_tracker(layout, protect, tmp_path,
                                                              reference_runs):
    """Attempt 0: rank 2 (last stage) is killed as it starts its first backward pass of
    iteration 3; the snapshot of 2 was still being copied (HAS: during 3's passes), so
    host memory holds 1 and the job resumes from the persistent checkpoint of 2. Attempt
    1: rank 0 dies after every rank wrote the checkpoint of iteration 4 and before it
    moved the tracker: the tracker still names 2, REFT-load serves the newest snapshot,
    nothing torn is ever loaded.

    Also the regression of a wrong state found by tools/chaos.py (seed 19): under
    megatron's non-distributed optimizer (pp2dp2), torch's ``load_state_dict`` replaced
    the Adam moment tensors after REFT's snapshot layout had captured them, so every
    snapshot after the persistent load copied dead tensors and attempt 2's REFT-load
    restored the moments of before that load."""
    save = str(tmp_path / "ckpt")
    base = TINY + N + LAYOUTS[layout]
    run = torchrun(4, base + reft(protect) + [
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "2:3@backward,0:4:KILL::1@save-tracker"], max_restarts=2).check()
    _fired(run, 2, 3, "backward")
    _fired(run, 0, 4, "save-tracker")
    # attempt 1: the checkpoint of 2 is newer than snapshot 1; attempt 2: snapshot 3 or 4
    # (the save of 4 comes after its step), never the untracked checkpoint 4's files
    assert [e["iteration"] for e in run.events_of("recovered_persistent")] == [2] * 4
    it = _resumed(run)
    same_as_reference(run, reference_runs(layout, 4, base), it + 1)
    assert it in (3, 4)
    assert {e["source"] for e in run.events_of("recovered")} == {"own"}
    assert _assert_tracker_whole(save) == 6


# ---- every compute / p2p moment, and the step ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("spec,rank,iteration,phase", [
    ("1:3@forward", 1, 3, "forward"),
    ("0:4@send", 0, 4, "send"),        # the first stage sends activations on
    ("3:3@recv", 3, 3, "recv"),        # the last stage waits for them
    ("2:4@backward", 2, 4, "backward"),
    ("1:3", 1, 3, "step"),             # the default phase: before the optimizer step
])
def test_kill_at_a_phase_recovers_from_host_memory(spec, rank, iteration, phase,
                                                  reference_runs):
    run = torchrun(4, BASE + REFT + ["--inject-fault", spec], max_restarts=1).check()
    _fired(run, rank, iteration, phase)
    assert run.output.count("[FAULT]") == 1
    resumed = _assert_same(run, reference_runs)
    # before the step the snapshot of ITER-1 is committed; inside the passes it may not be
    assert resumed in ((iteration - 1,) if phase == "step" else (iteration - 2, iteration - 1))
    assert all(e["source"] == "own" for e in run.events_of("recovered"))


# ---- a persistent save at each of its moments (REFT off: the checkpoint is the state) --
@pytest.mark.slow
@pytest.mark.parametrize("spec,extra,loads", [
    ("1:4@save", [], 2),                     # nothing of iteration 4 written yet
    ("0:4@save-tracker", [], 2),             # iter_0000004 complete, the tracker still 2
    ("1:4@save-done", [], 4),                # the tracker names 4
    ("1:4@save-async", ["--async-save"], 2),  # the writer process dies, the rank lives on
])
def test_fault_during_a_persistent_save_never_loads_a_torn_checkpoint(spec, extra, loads,
                                                                     tmp_path,
                                                                     reference_runs):
    save = str(tmp_path / "ckpt")
    run = torchrun(4, BASE + extra + ["--save", save, "--load", save, "--save-interval", "2",
                                      "--inject-fault", spec], max_restarts=1).check()
    rank, it = int(spec.split(":")[0]), int(spec.split(":")[1].split("@")[0])
    _fired(run, rank, it, spec.split("@")[1])
    assert re.findall(r"loaded checkpoint \S+ at iteration (\d+)", run.output) == \
        [str(loads)], run.output[-3000:]
    assert _assert_same(run, reference_runs) == loads
    assert _assert_tracker_whole(save) == 6


# ---- the start-up health check ----------------------------------------------------------
@pytest.mark.slow
def test_kill_during_the_health_check_of_a_restart(reference_runs):
    """Attempt 0: rank 1 is killed before its step of iteration 3 (snapshot 2
    committed). Attempt 1 resumes from 2: rank 2 is killed inside its start-up health
    check (ITER of @health = the iteration the attempt resumes from). A crashed rank is
    not a failed node: attempt 2 checks again, passes, and resumes from 2."""
    run = torchrun(4, BASE + REFT + ["--inject-fault", "1:3,2:2:KILL::1@health"],
                   max_restarts=2).check()
    _fired(run, 1, 3, "step")
    _fired(run, 2, 2, "health")
    assert not run.events_of("health_stop") and not run.events_of("shrink")
    assert _assert_same(run, reference_runs) == 2


# ---- other signals ----------------------------------------------------------------------
@pytest.mark.slow
def test_stopped_in_forward_is_killed_by_the_hang_monitor(reference_runs):
    """SIGSTOP as rank 1 starts computing iteration 3's forward: its heartbeat says
    computing, the node watcher kills it after --reft-hang-timeout, the job recovers."""
    run = torchrun(4, BASE + REFT + ["--reft-hang-timeout", "5",
                                     "--inject-fault", "1:3:STOP@forward"],
                   max_restarts=1, timeout=240).check()
    _fired(run, 1, 3, "forward", "SIGSTOP")
    hang = run.events.one("hang")
    assert (hang["rank"], hang["state"], hang["process"]) == (1, "computing", "stopped"), hang
    _assert_same(run, reference_runs)


@pytest.mark.slow
def test_terminated_in_recv(reference_runs):
    """SIGTERM (no --exit-signal-handler: the default action) while rank 3 waits for
    iteration 3's activations."""
    run = torchrun(4, BASE + REFT + ["--inject-fault", "3:3:TERM@recv"],
                   max_restarts=1).check()
    _fired(run, 3, 3, "recv", "SIGTERM")
    _assert_same(run, reference_runs)


# ---- a full /dev/shm --------------------------------------------------------------------
@pytest.mark.slow
def test_shm_full_when_a_lost_node_comes_back(reference_runs):
    """Attempt 0: rank 1's failure domain is lost at iteration 3 (its shared memory
    wiped). Attempt 1 must create rank 1's segments again, and /dev/shm is full (@health
    arms it, before the session opens): the segments are reserved by a thread while
    REFT-load runs, and the first use of the one it could not make (the live AOR buffer,
    before the first step) stops that rank with its ShmSpaceError line; nothing torn is
    left behind, and attempt 2 rebuilds rank 1 from its peer's ARC replica and AOR
    replica and ends bit-identical."""
    run = torchrun(4, BASE + REFT + ["--inject-fault",
                                     "1:3:KILL:node,1:2:KILL:shm-full:1@health"],
                   max_restarts=2).check()
    _fired(run, 1, 3, "step")
    assert re.search(r"\[FAULT\] shared memory full for rank 1 \(pid \d+\) at iteration "
                     r"2, phase health", run.output), run.output[-3000:]
    assert re.search(r"error: shared-memory segment \S+/rank1\.(aor|slot\d)\.bin needs \d+ "
                     r"more bytes", run.output), run.output[-3000:]
    assert "Bus error" not in run.output and "SIGBUS" not in run.output
    assert _assert_same(run, reference_runs) == 2
    assert run.events_of("recovered", rank=1, iteration=2, source="replica")
