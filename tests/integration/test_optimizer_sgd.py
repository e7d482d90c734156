"""Megatron's ``--optimizer sgd`` with momentum end to end: its momentum buffers (which
torch creates lazily inside the first ``step()``) are in every REFT snapshot, a crash
recovers from host memory bit-exactly, and a persistent checkpoint resumes
bit-exactly (megatron/training/optimizer_state.py)."""

import os
import re

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import N, OWN, assert_recovered, reft
from tests.harness.run import TINY, torchrun

SGD = ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--global-batch-size", "4"]  # DP2


def _params_per_rank(output: str) -> int:
    counts = {int(n) for n in re.findall(r"parameters on this rank: (\d+)", output)}
    assert len(counts) == 1, counts  # DP2: both ranks hold the whole model
    return counts.pop()


@pytest.mark.slow  # make test's budget (the real-Slurm tests): SGD's state capture is
# bitwise-tested against torch's lazy state in the unit tests of the default tier
def test_sgd_momentum_crash_recovers_bit_exactly(reference_runs):
    """Rank 1 is SIGKILLed before iteration 5's step; both ranks reload iteration 4
    from their own memory and end bit-identical to the failure-free run. Each rank's
    slice of the snapshot holds half of params + momentum buffers (fp32, replicated
    over DP2): twice what the params alone would fill, so the buffers were captured."""
    ref = reference_runs("dp2-sgd", 2, TINY + N + SGD)
    run = torchrun(2, TINY + N + SGD + reft("arc") + ["--inject-fault", "1:5"],
                   max_restarts=1).check()
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert run.output.count("[FAULT] injecting") == 1
    assert_recovered(run.events, 4, {0: OWN, 1: OWN})
    state_bytes = 2 * 4 * _params_per_rank(run.output)  # params + momentum, fp32
    for snap in run.events_of("snapshot"):
        own = snap["per_rank"]["own"]
        # the replicated state cut into 2 slices (plus a little padding); without the
        # buffers it would be half of this
        assert state_bytes <= 2 * own < 1.25 * state_bytes, (snap, state_bytes)
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # two more 2-rank runs; the default tier covers SGD's REFT recovery
def test_sgd_momentum_resumes_from_a_checkpoint_bit_exactly(tmp_path, reference_runs):
    ref = reference_runs("dp2-sgd", 2, TINY + N + SGD)
    save = str(tmp_path / "ckpt")
    args = TINY + N + SGD + ["--save", save]
    first = torchrun(2, args + ["--exit-interval", "3"]).check()
    assert first.iteration == 3
    second = torchrun(2, args + ["--load", save]).check()
    assert f"loaded checkpoint {save}/iter_0000003" in second.output
    assert os.path.isdir(os.path.join(save, "iter_0000003"))
    same_as_reference(second, ref, 4)
