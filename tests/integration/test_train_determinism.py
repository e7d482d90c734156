"""Two runs with one seed give bit-identical losses and final state on every rank, for
the layouts we support (all real torchrun processes on gloo)."""

import math

import pytest

from tests.harness.compare import same_state
from tests.harness.run import LAYOUTS, TINY, torchrun

ITERS = ["--train-iters", "6"]


# `make test-all`: in the default tier every recovery test is a second run of its
# layout compared bit for bit (hashes, losses, checkpoint) with the failure-free one
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_runs_bit_identical(layout, reference_runs):
    args = TINY + ITERS + LAYOUTS[layout]
    first = reference_runs(layout, 4, args)
    second = torchrun(4, args).check()
    assert sorted(first.hashes) == [0, 1, 2, 3]
    assert first.losses and sorted(first.losses) == list(range(1, 7))
    assert all(math.isfinite(float.fromhex(v)) for v in first.losses.values())
    same_state(second, first)  # hashes, every rank's losses, the final checkpoints


@pytest.mark.slow
def test_loss_falls_and_seed_matters(reference_runs):
    args = TINY + ITERS + LAYOUTS["pp2dp2-zero1"]
    ref = reference_runs("pp2dp2-zero1", 4, args)
    other = torchrun(4, args + ["--seed", "4321"]).check()
    assert other.hashes != ref.hashes  # a different seed gives a different run
    first, last = float.fromhex(ref.losses[1]), float.fromhex(ref.losses[6])
    assert last < first
