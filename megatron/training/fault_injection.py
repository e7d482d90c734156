"""``--inject-fault RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]][,...]``: kill ranks at an
iteration, on one torchrun attempt (the first by default).

The fault fires during iteration ITER on global rank RANK, after its forward and backward
passes and right before its optimizer step (so ITER-1 iterations are complete everywhere,
and under ``--reft-schedule has`` the snapshot of ITER-1, copied during ITER's passes, is
committed), and only while ``TORCHELASTIC_RESTART_COUNT`` equals ATTEMPT (default 0; unset outside
torchrun counts as 0), so the job restarted by torchrun runs through. Before the signal is
sent, one line ``[FAULT] ...`` is printed and flushed: tests assert on it to prove the
fault really fired. MODE (REFT runs):

* ``node``: the rank's failure domain loses its shared memory too (a lost node);
* ``snapshot``: the kill lands halfway through writing iteration ITER's snapshot;
* ``corrupt``: one byte of the rank's last committed snapshot (its own slice) is
  flipped first;
* ``corrupt-replica``: one byte of the ARC replica the rank holds in that snapshot (its
  redundancy region: the slice of the next member of its sharding group) is flipped;
* ``corrupt-manifest``: that snapshot's manifest is rewritten, still valid JSON, with one
  value changed (the restored consumed-samples counter one global batch ahead) and its
  stored checksum kept;
* ``corrupt-committed``: the rank's commit pointer is rewritten the same way, naming the
  iteration after the committed one.

With SIGNAL ``CONT`` (a signal that does not stop the process) a corrupt mode only
corrupts: the rank trains on, and the damage lies in host memory until a later
recovery reads it (two corruptions on two ranks, one kill: no race between them).

This module decides when a fault fires; the REFT part of a mode (wiping, corrupting,
the moment halfway through a snapshot write) is reft_ext/testing/faults.py, reached
through reft_ext.testing.fault_point (nothing there unless REFT installed its observer).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from megatron.training.errors import ArgumentError
from reft_ext.testing import fault_point

CORRUPT_MODES = ("corrupt", "corrupt-replica", "corrupt-manifest", "corrupt-committed")
MODES = ("", "node", "snapshot", *CORRUPT_MODES)


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    signal: int = signal.SIGKILL
    mode: str = ""
    attempt: int = 0


def parse_fault_spec(spec: str, world_size: int | None = None) -> FaultSpec:
    """Parse ``RANK:ITER[:SIGNAL]`` (SIGNAL as a name like SIGKILL/KILL/TERM or a number)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3, 4, 5):
        raise ArgumentError(f"--inject-fault: expected RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]], "
                            f"got {spec!r}")
    mode = parts[3] if len(parts) >= 4 else ""
    attempt = parts[4] if len(parts) == 5 else "0"
    if not attempt.isdigit():
        raise ArgumentError(f"--inject-fault: ATTEMPT must be an integer, got {attempt!r}")
    if mode not in MODES:
        raise ArgumentError(f"--inject-fault: unknown mode {mode!r} "
                            f"({', '.join(m for m in MODES if m)})")
    try:
        rank, iteration = int(parts[0]), int(parts[1])
    except ValueError:
        raise ArgumentError(f"--inject-fault: RANK and ITER must be integers, got {spec!r}")
    sig = signal.SIGKILL
    if len(parts) >= 3 and parts[2]:
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
    return FaultSpec(rank, iteration, int(sig), mode, int(attempt))


def parse_fault_specs(text: str, world_size: int | None = None) -> list[FaultSpec]:
    return [parse_fault_spec(p, world_size) for p in text.split(",") if p]


def attempt() -> int:
    """The job's attempt as this rank sees it. A replacement agent started by
    tools/launch_nodes.py counts its restarts from 0 again: the launcher passes how many
    agents of that node slot came before (REFT_NODE_GENERATION), so a fault meant for
    attempt 0 does not fire again on the node that replaced the failed one."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) +
            int(os.environ.get("REFT_NODE_GENERATION", "0")))


def maybe_inject_fault(specs, rank: int, iteration: int) -> None:
    """Call before the optimizer step of ``iteration``."""
    for spec in specs or ():
        if rank == spec.rank and iteration == spec.iteration and spec.mode != "snapshot":
            fire(spec, f"at iteration {iteration}")


def fire_in_snapshot(specs, iteration: int) -> None:
    """Halfway through writing ``iteration``'s snapshot (reft_ext/testing/faults.py calls
    this from the snapshot write): this rank's ``snapshot`` faults of that iteration."""
    for spec in specs or ():
        if spec.mode == "snapshot" and spec.iteration == iteration:
            fire(spec, "during its snapshot write")


def fire(spec: FaultSpec, when: str) -> None:
    if attempt() != spec.attempt:
        return
    if spec.mode == "node":  # REFT (if on) wipes the failure domain's shared memory
        fault_point("node-loss")
    if spec.mode in CORRUPT_MODES:  # REFT (if on) damages the last committed snapshot
        fault_point("corrupt", mode=spec.mode)
    name = signal.Signals(spec.signal).name
    from megatron.training.utils import emit  # (imports torch: not at flag parsing)

    emit(f"[FAULT] injecting {name} into rank {spec.rank} (pid {os.getpid()}) {when}"
          f"{' (node loss)' if spec.mode == 'node' else ''}")
    sys.stderr.flush()
    os.kill(os.getpid(), spec.signal)
    # a catchable signal (SIGTERM with --exit-signal-handler) lets the process go on; give
    # the handler a moment to run before training continues
    time.sleep(0.1)


# ---- loss spikes (tests of --reft-rollback-on) -----------------------------------------
SPIKE_KINDS = ("scale", "nan")
SPIKE_SCALE = 1e4


@dataclass(frozen=True)
class SpikeSpec:
    rank: int
    iteration: int
    kind: str = "scale"


def parse_spike_specs(text: str, world_size: int | None = None) -> list[SpikeSpec]:
    """``RANK:ITER[:scale|nan][,...]``."""
    out = []
    for part in (p for p in text.split(",") if p):
        bits = part.split(":")
        kind = bits[2] if len(bits) == 3 else "scale"
        if len(bits) not in (2, 3) or not all(b.isdigit() for b in bits[:2]) or \
                kind not in SPIKE_KINDS:
            raise ArgumentError(f"--inject-spike: expected RANK:ITER[:scale|nan], got {part!r}")
        rank, iteration = int(bits[0]), int(bits[1])
        if world_size is not None and rank >= world_size:
            raise ArgumentError(f"--inject-spike: rank {rank} is outside the world of "
                                f"{world_size} ranks")
        if iteration < 1:
            raise ArgumentError(f"--inject-spike: iteration must be >= 1, got {iteration}")
        out.append(SpikeSpec(rank, iteration, kind))
    return out


def maybe_inject_spike(specs, rank: int, iteration: int, model, fired: set) -> None:
    """Before ``iteration``'s optimizer step: this rank's gradients (megatron's main_grad,
    which the optimizer reads) scaled by SPIKE_SCALE or made NaN; each spec fires once per
    process, so the iteration redone after the rollback runs clean."""
    import torch

    from megatron.training.utils import emit

    for spec in specs or ():
        if spec.rank != rank or spec.iteration != iteration or spec in fired:
            continue
        fired.add(spec)
        with torch.no_grad():
            for chunk in model:
                for p in chunk.parameters():
                    g = getattr(p, "main_grad", None)
                    if g is None:
                        continue
                    if spec.kind == "nan":
                        g.fill_(float("nan"))
                    else:
                        g.mul_(SPIKE_SCALE)
        emit(f"[FAULT] spike: rank {rank}'s gradients "
              f"{'made NaN' if spec.kind == 'nan' else f'scaled by {SPIKE_SCALE:g}'} "
              f"before the optimizer step of iteration {iteration}")
