"""``--inject-fault RANK:ITER[:SIGNAL]``: kill one rank at one iteration, first attempt only.

The fault fires when iteration ITER begins on global rank RANK (so ITER-1 iterations
are complete everywhere), and only while ``TORCHELASTIC_RESTART_COUNT`` is 0 (or unset
outside torchrun), so the job restarted by torchrun runs through. Before the signal is
sent, one line ``[FAULT] ...`` is printed and flushed: tests assert on it to prove the
fault really fired.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    signal: int = signal.SIGKILL


def parse_fault_spec(spec: str, world_size: int | None = None) -> FaultSpec:
    """Parse ``RANK:ITER[:SIGNAL]`` (SIGNAL as a name like SIGKILL/KILL/TERM or a number)."""
    from megatron.training.arguments import ArgumentError

    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ArgumentError(f"--inject-fault: expected RANK:ITER[:SIGNAL], got {spec!r}")
    try:
        rank, iteration = int(parts[0]), int(parts[1])
    except ValueError:
        raise ArgumentError(f"--inject-fault: RANK and ITER must be integers, got {spec!r}")
    sig = signal.SIGKILL
    if len(parts) == 3:
        name = parts[2].upper()
        try:
            sig = signal.Signals(int(name)) if name.isdigit() else \
                signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise ArgumentError(f"--inject-fault: unknown signal {parts[2]!r}")
    if rank < 0 or (world_size is not None and rank >= world_size):
        raise ArgumentError(f"--inject-fault: rank {rank} is outside the world of "
                            f"{world_size} ranks")
    if iteration < 1:
        raise ArgumentError(f"--inject-fault: iteration must be >= 1, got {iteration}")
    return FaultSpec(rank, iteration, int(sig))


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def maybe_inject_fault(spec: FaultSpec | None, rank: int, iteration: int) -> None:
    """Call at the start of each iteration (``iteration`` = the one about to run)."""
    if spec is None or rank != spec.rank or iteration != spec.iteration or not first_attempt():
        return
    name = signal.Signals(spec.signal).name
    print(f"[FAULT] injecting {name} into rank {rank} (pid {os.getpid()}) at iteration "
          f"{iteration}", flush=True)
    sys.stderr.flush()
    os.kill(os.getpid(), spec.signal)
    # a catchable signal (SIGTERM with --exit-signal-handler) lets the process go on; give
    # the handler a moment to run before training continues
    time.sleep(0.1)
