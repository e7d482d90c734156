"""Several ranks on one GPU stage every collective through host copies
(megatron/training/gloo_device.py). Here megatron-core's real DDP with the distributed
optimizer (ZeRO-1: its reduce-scatter writes a view of its own input) trains once plain
and once with every collective staged (tests/workers/staged_trainer.py: the predicate
stages host tensors, as the device path stages device ones): the losses and the final
state are bit-identical. The staged run must really have staged the reduce-scatter and
the all-gather, through megatron-core's aliases (param_and_grad_buffer's; those of
tensor_parallel.mappings are swapped too, and sequence parallelism's mappings, which
torch's LayerNorm refuses on CPU, are checked on two gloo ranks in
tests/unit/test_gpu_multirank.py)."""

from __future__ import annotations

import re

import pytest

from tests.harness.run import LAYOUTS, TINY, torchrun

ITERS = ["--train-iters", "3"]


def _staged(nproc: int, args: list[str]):
    res = torchrun(nproc, args, script="tests/workers/staged_trainer.py", timeout=400).check()
    counts = {}
    for rank, text in re.findall(r"\[STAGED\] rank (\d+) (?!aliases)(.*)", res.output):
        counts[int(rank)] = dict((k, int(v)) for k, v in re.findall(r"(\w+):(\d+)", text))
    aliases = set(" ".join(re.findall(r"\[STAGED\] rank \d+ aliases (.*)",
                                      res.output)).split())
    return res, counts, aliases


def _same(plain, staged):
    assert plain.losses and plain.losses == staged.losses
    assert plain.hashes and plain.hashes == staged.hashes


def test_zero1_dp2_staged_equals_plain():
    args = [*TINY, *ITERS, "--use-distributed-optimizer", "--global-batch-size", "8"]
    plain = torchrun(2, args, timeout=400).check()
    staged, counts, aliases = _staged(2, args)
    assert set(counts) == {0, 1}
    for c in counts.values():  # ZeRO-1's grad reduce-scatter and param all-gather staged
        assert c.get("reduce_scatter_tensor", 0) + c.get("_reduce_scatter_base", 0) > 0, c
        assert c.get("all_gather_into_tensor", 0) + c.get("_all_gather_base", 0) > 0, c
    assert any(a.endswith("param_and_grad_buffer.dist_reduce_scatter_func")
               for a in aliases), aliases
    _same(plain, staged)


@pytest.mark.slow
def test_tp2_dp2_zero1_staged_equals_plain():
    args = [*TINY, *ITERS, *LAYOUTS["tp2dp2-zero1"]]
    plain = torchrun(4, args, timeout=600).check()
    staged, counts, aliases = _staged(4, args)
    assert set(counts) == {0, 1, 2, 3}
    assert any(a.endswith("tensor_parallel.mappings.dist_reduce_scatter_func")
               for a in aliases), aliases
    for c in counts.values():  # TP's all-reduces and ZeRO-1's gathers staged too
        assert c.get("all_reduce", 0) > 0 and c.get("_all_gather_base", 0) + \
            c.get("all_gather_into_tensor", 0) > 0, c
    _same(plain, staged)
