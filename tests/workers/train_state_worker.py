"""Train, capture the TrainingState in memory at iteration 3, train to 5, restore the
capture, train 4..5 again: the second pass must reproduce the first bit for bit on every
rank (parameters, optimizer state, RNG, scheduler, data position). Prints [ROLLBACK]."""

import sys


import torch

from megatron.training.arguments import parse_args
from megatron.training.hooks import TrainerHook
from megatron.training.train_state import params_hash
from megatron.training.training import Trainer


class Rollback(TrainerHook):
    def __init__(self, trainer):
        self.trainer, self.snap, self.first = trainer, None, None

    def after_step(self, state):
        if state.iteration == 3 and self.snap is None:
            self.snap = state.capture()
        elif state.iteration == 5 and self.first is None:
            self.first = (params_hash(state), dict(self.trainer.losses))
            state.restore(self.snap)
            self.trainer._build_data()  # the data position comes back with the counters
            assert state.iteration == 3


def main():
    args = parse_args(sys.argv[1:])
    trainer = Trainer(args)
    probe = Rollback(trainer)
    trainer.hooks.append(probe)
    state = trainer.train()
    rank = torch.distributed.get_rank()
    h1, losses1 = probe.first
    assert params_hash(state) == h1, f"rank {rank}: state differs after rollback"
    assert all(trainer.losses[i] == losses1[i] for i in losses1 if i > 3)
    print(f"[ROLLBACK] rank {rank} ok iterations {sorted(trainer.losses)}", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
