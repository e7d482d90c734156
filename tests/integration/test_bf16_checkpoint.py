"""bf16 with the non-distributed optimizer: saving a checkpoint failed ("Param id N does
not match any model sharded param": the fp32 RMSNorm weights' optimizer state,
optimizer_checkpoint_fixes.py's upstream bug 5). N iterations in one go == N/2, save, stop, restart
with --load, N/2 more, bit for bit (state hash, final checkpoint, every loss)."""

import os

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.run import TINY, torchrun

N = 6
# DP2, bf16, megatron's Float16OptimizerWithFloat16Params (no --use-distributed-optimizer)
ARGS = TINY + ["--train-iters", str(N), "--global-batch-size", "4", "--bf16"]


@pytest.mark.slow  # three 2-rank jobs
def test_bf16_dp2_resume_bit_exact(tmp_path, reference_runs):
    ref = reference_runs("dp2-bf16", 2, ARGS)
    save = str(tmp_path / "ckpt")
    first = torchrun(2, ARGS + ["--save", save, "--exit-interval", str(N // 2)]).check()
    assert first.iteration == N // 2
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "3"
    second = torchrun(2, ARGS + ["--save", save, "--load", save]).check()
    assert f"loaded checkpoint {save}/iter_0000003" in second.output
    assert second.iteration == N
    same_as_reference(second, ref, N // 2 + 1, N)
