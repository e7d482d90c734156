"""``--exit-signal-handler``: SIGTERM (preemption) -> save and exit at the iteration end.

Every rank must agree to stop at the same iteration (or the others hang in the next
collective), so the flag is max-reduced over the world once per iteration, as
Megatron-LM's DistributedSignalHandler does.
"""

from __future__ import annotations

import signal

import torch


class ExitSignal:
    def __init__(self, sig: int = signal.SIGTERM):
        self.received = False
        self._previous = signal.signal(sig, self._handler)

    def _handler(self, signum, frame):  # noqa: ARG002 - signal API
        self.received = True

    def received_anywhere(self) -> bool:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
