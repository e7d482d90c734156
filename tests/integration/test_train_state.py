"""The training state has one home: captured in memory and restored, training repeats
itself bit for bit (the basis of every REFT snapshot)."""

from tests.harness.run import LAYOUTS, TINY, torchrun


def test_capture_restore_repeats_training_bitwise():
    run = torchrun(4, TINY + ["--train-iters", "5"] + LAYOUTS["pp2dp2-zero1"],
                   script="tests/workers/train_state_worker.py").check()
    assert run.output.count("[ROLLBACK]") == 4
    assert "[ROLLBACK] rank 3 ok iterations [1, 2, 3, 4, 5]" in run.output
