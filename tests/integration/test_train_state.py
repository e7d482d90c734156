"""The training state has one home: captured in memory and restored, training repeats
itself bit for bit (the basis of every REFT snapshot)."""

import re

import pytest

from tests.harness.run import LAYOUTS, TINY, torchrun


@pytest.mark.slow  # make test's budget: every recovery test of the default tier restores
# a captured state and trains on bit for bit
def test_capture_restore_repeats_training_bitwise():
    run = torchrun(4, TINY + ["--train-iters", "5"] + LAYOUTS["pp2dp2-zero1"],
                   script="tests/workers/train_state_worker.py").check()
    lines = sorted(re.findall(r"\[ROLLBACK\] rank \d+ ok iterations \[[^\]]*\] \w+ stage",
                              run.output))
    # every rank checked its state; the last pipeline stage (ranks 2, 3 of pp2dp2) its
    # losses too, the first stage that it has none
    assert lines == [f"[ROLLBACK] rank {r} ok iterations {its} {stage} stage"
                     for r, its, stage in [(0, [], "inner"), (1, [], "inner"),
                                           (2, [1, 2, 3, 4, 5], "last"),
                                           (3, [1, 2, 3, 4, 5], "last")]], run.output[-4000:]
