"""Exact resume from persistent checkpoints: N iterations in one go == N/2, save, stop,
restart with --load, N/2 more. Also through a SIGKILL of one rank under torchrun
--max-restarts 1, resuming from the last checkpoint."""

import os

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.run import LAYOUTS, TINY, torchrun

N = 6
ITERS = ["--train-iters", str(N)]


def _half_and_half(layout, tmp_path, extra_first=()):
    save = str(tmp_path / "ckpt")
    args = TINY + ITERS + LAYOUTS[layout] + ["--save", save]
    first = torchrun(4, args + ["--exit-interval", str(N // 2), *extra_first]).check()
    assert first.iteration == N // 2
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "3"
    second = torchrun(4, args + ["--load", save]).check()
    assert f"loaded checkpoint {save}/iter_0000003" in second.output
    return first, second


@pytest.mark.parametrize("layout,extra", [
    # the default tier resumes from checkpoints bit-exactly in test_fault_phases.py and
    # test_sigkill_one_rank_then_torchrun_restart below
    pytest.param("pp2dp2-zero1", (), marks=pytest.mark.slow),
    pytest.param("tp2pp2", ("--async-save",), marks=pytest.mark.slow),
    # chunks with the same local key names (tools/chaos.py found saving refused)
    pytest.param("pp2-interleaved", (), marks=pytest.mark.slow)])
def test_resume_bit_exact(layout, extra, tmp_path, reference_runs):
    ref = reference_runs(layout, 4, TINY + ITERS + LAYOUTS[layout])
    _, second = _half_and_half(layout, tmp_path, extra)
    assert second.iteration == N
    same_as_reference(second, ref, 4)


@pytest.mark.slow  # kill -> persistent resume: test_fault_phases.py in the default tier
def test_sigkill_one_rank_then_torchrun_restart(tmp_path, reference_runs):
    layout = "pp2dp2-zero1"
    ref = reference_runs(layout, 4, TINY + ITERS + LAYOUTS[layout])
    save = str(tmp_path / "ckpt")
    args = TINY + ITERS + LAYOUTS[layout] + [
        "--save", save, "--load", save, "--save-interval", "2", "--inject-fault", "1:5"]
    run = torchrun(4, args, max_restarts=1).check()
    # the fault really fired, the job really restarted and reloaded iteration 4
    assert "[FAULT] injecting SIGKILL into rank 1" in run.output
    assert run.output.count("[FAULT]") == 1
    assert f"loaded checkpoint {save}/iter_0000004" in run.output
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # make test's 12 minutes; SIGTERM in the default tier: test_preemption.py
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    save = str(tmp_path / "ckpt")
    args = TINY + ITERS + LAYOUTS["dp4"] + [
        "--save", save, "--exit-signal-handler", "--inject-fault", "2:3:SIGTERM"]
    run = torchrun(4, args).check()
    assert "[FAULT] injecting SIGTERM into rank 2" in run.output
    assert "exit signal received: stopping at iteration 3" in run.output
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "3"
    assert run.iteration == 3
