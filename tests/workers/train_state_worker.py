"""Train, capture the TrainingState in memory at iteration 3, train to 5, restore the
capture, train 4..5 again: the second pass must reproduce the first bit for bit on every
rank (parameters, optimizer state, RNG, scheduler, data position). Every rank checks what
it holds: its whole state (which iterations 4..5 must have changed, and the second pass
must bring back bit for bit) on every rank, the losses on the last pipeline stage (the
only ranks that compute them: the others must have none). Prints [ROLLBACK]."""

import math
import sys

import torch
from megatron.core import parallel_state as mpu

from megatron.training.arguments import parse_args
from megatron.training.hooks import TrainerHook
from megatron.training.train_state import params_hash
from megatron.training.training import Trainer
from megatron.training.utils import emit


class Rollback(TrainerHook):
    def __init__(self, trainer):
        self.trainer, self.snap, self.first = trainer, None, None
        self.at3 = None  # the state hash at the capture
        self.seen: list[int] = []  # every iteration completed, both passes

    def after_step(self, state):
        self.seen.append(state.iteration)
        if state.iteration == 3 and self.snap is None:
            self.snap = state.capture()
            self.at3 = params_hash(state)
        elif state.iteration == 5 and self.first is None:
            self.first = (params_hash(state), dict(self.trainer.losses))
            state.restore(self.snap)
            self.trainer._build_data()  # the data position comes back with the counters
            assert state.iteration == 3 and params_hash(state) == self.at3
            # the losses of 4..5 must be computed again, not left from the first pass
            self.trainer.losses = {i: v for i, v in self.trainer.losses.items() if i <= 3}


def main():
    args = parse_args(sys.argv[1:])
    trainer = Trainer(args)
    probe = Rollback(trainer)
    trainer.hooks.append(probe)
    state = trainer.train()
    rank = torch.distributed.get_rank()
    h1, losses1 = probe.first
    assert probe.seen == [1, 2, 3, 4, 5, 4, 5], f"rank {rank}: iterations {probe.seen}"
    assert h1 != probe.at3, f"rank {rank}: iterations 4..5 left the state unchanged"
    assert params_hash(state) == h1, f"rank {rank}: state differs after rollback"
    assert all(bool(torch.isfinite(t).all()) for _, t in state.state_tensors()
               if t.is_floating_point()), f"rank {rank}: a non-finite state value"
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    if last:  # computes the loss: every iteration's, and the redone ones equal
        assert sorted(losses1) == sorted(trainer.losses) == [1, 2, 3, 4, 5], \
            (rank, losses1, trainer.losses)
        assert [trainer.losses[i] for i in (4, 5)] == [losses1[i] for i in (4, 5)], \
            (rank, losses1, trainer.losses)
        assert all(math.isfinite(float.fromhex(v)) for v in trainer.losses.values())
    else:  # no loss here, in either pass
        assert losses1 == {} and trainer.losses == {}, (rank, losses1, trainer.losses)
    emit(f"[ROLLBACK] rank {rank} ok iterations {sorted(trainer.losses)} "
         f"{'last' if last else 'inner'} stage")  # one write: ranks share the pipe
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
