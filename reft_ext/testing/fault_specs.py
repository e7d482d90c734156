"""``--inject-fault SPEC[,SPEC...]``: faults at a chosen moment of a run (tests, demos and
tools/chaos.py), each ``SPEC`` being

    RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]][@PHASE]

The fault fires on global rank RANK, during iteration ITER, at the moment PHASE (default
``step``), and only while the job's attempt (``TORCHELASTIC_RESTART_COUNT``, plus
``REFT_NODE_GENERATION`` under tools/launch_nodes.py, plus the generation ``REFT_GENERATION``
under its in-process supervisor; unset outside torchrun counts as 0)
equals ATTEMPT (default 0), so the job restarted by torchrun runs through. Each spec
fires at most once per process. Before the signal is sent, one line

    [FAULT] injecting SIGKILL into rank R (pid P) at iteration ITER, phase PHASE ...

is printed and flushed: tests assert on it to prove the fault really fired. SIGNAL is a
name (``SIGKILL``/``KILL``, ``TERM``, ``STOP``: a hang that REFT's hang monitor or the
node watcher must end, ``CONT``: no stop at all) or a number; default SIGKILL.

PHASE (the moment inside iteration ITER; each is a ``reft_ext.testing.fault_point(PHASE,
iteration=ITER)`` in the code):

trainer side
* ``forward`` / ``backward``: the rank starts computing a micro-batch's forward /
  backward pass (the first one of ITER);
* ``send`` / ``recv``: the rank starts a pipeline p2p exchange that sends / receives
  activations or gradients (needs pipeline parallelism);
* ``step`` (default): after the rank's forward and backward passes, right before its
  optimizer step (so ITER-1 iterations are complete everywhere and, under
  ``--reft-schedule has``, the snapshot of ITER-1 copied during ITER's passes is
  committed);
* ``save``: the persistent checkpoint of iteration ITER (``--save``) is about to be
  written; ``save-tracker``: its files are written, the tracker file
  (latest_checkpointed_iteration.txt) not yet; ``save-done``: after the tracker;
  ``save-async``: inside the background write of an ``--async-save`` checkpoint;
* ``health``: as the start-up health check (``--reft-health-check``) begins, before its
  checks and before any state is loaded. Here ITER is the iteration the attempt resumes
  from (the newest committed REFT snapshot of any rank or the persistent tracker's
  iteration, whichever is newer; 0 for a fresh start) and ATTEMPT the job-wide attempt
  (the highest restart count among the ranks); ITER 0 is allowed here;
* ``join``: the start-up's (or an in-process restart's rejoin's) job-wide part, after the
  state was loaded or restored (ITER: its iteration, 0 for a fresh start), before the
  ranks agree on what they go on with (megatron/training/training.py ``_agree_start``);
* ``data``: the datasets and iterators are about to be built (ITER: the iteration the
  data is read from; 0 at a fresh start), the peers inside megatron-core's dataset
  build and its barriers;

library side (REFT runs; reft_ext calls them)
* ``has-copy``: a HAS unit being copied; ``snapshot-write``: halfway through writing
  iteration ITER's snapshot; ``commit``: inside the job-wide commit agreement of ITER's
  snapshot (after the all-reduce, before the commit pointer moves); ``aor``: the AOR
  transport of iteration ITER; ``load-read`` / ``load-exchange`` / ``load-rebuild``:
  REFT-load while recovering (ITER = the iteration being restored); ``flush``: the node
  watcher flushing a snapshot to disk (the watcher is a process of its own: this phase is
  set through ``REFT_WATCHER_FAULT=flush:NODE[:ATTEMPT]``, tools/chaos.py does;
  ``--inject-fault ...@flush`` is refused); ``on-start``: REFT's session start (its
  ``on_start``; ITER the iteration training resumes from, 0 allowed), the peers in its
  job-wide sum and AOR start-up.

MODE:

* ``node``: the rank's failure domain loses its shared memory too (a lost node);
* ``snapshot``: the same as ``@snapshot-write`` (the kill lands halfway through writing
  iteration ITER's snapshot); kept from the grammar without phases;
* ``corrupt``: one byte of the rank's last committed snapshot (its own slice) is
  flipped first;
* ``corrupt-replica``: one byte of the ARC replica the rank holds in that snapshot (its
  redundancy region: the slice of the next member of its sharding group) is flipped;
* ``corrupt-manifest``: that snapshot's manifest is rewritten, still valid JSON, with one
  value changed (the restored consumed-samples counter one global batch ahead) and its
  stored checksum kept;
* ``corrupt-committed``: the rank's commit pointer is rewritten the same way, naming the
  iteration after the committed one;
* ``shm-full``: no signal (SIGNAL is ignored): from that moment the rank's next
  shared-memory space reservation (reft_ext/store/shm.py: a segment created or grown)
  fails with ENOSPC, as on a full /dev/shm. REFT reserves all its snapshot slots when
  its session opens, so that reservation is the next session opening of the rank: use
  ``@health`` (before the session opens), e.g. on the attempt after a ``node`` fault
  wiped the rank's slots. REFT then stops the rank with its ShmSpaceError line
  (``error: shared-memory segment ... needs N more bytes ...``) and the restart finds
  the last good snapshots intact. Mid-run the slots are reserved already: a full
  /dev/shm takes no page from a snapshot, the fault stays armed and nothing fails.

* ``corrupt-send``: no signal (SIGNAL is ignored): from that moment every payload
  the rank sends to a peer during a REFT-load (a slice, a parity block, an AOR replica)
  has one byte flipped in the copy that is sent, as a corruption in transit would; its
  snapshot stays intact. Arm it before the exchange: ``@load-read`` of the restoring
  attempt (ITER the iteration being restored), e.g. ``0:4:CONT:corrupt-send:1@load-read``.
  The receiver must catch it (reft_ext/load/received.py).

* ``slow``: no signal (SIGNAL is ignored; write ``CONT``), and the fifth field is a
  factor F, not ATTEMPT (``RANK:ITER:CONT:slow:F``, F > 1, default 2): from iteration
  ITER on, on every attempt, the rank sleeps F - 1 times its forward-backward compute
  before each gradient sync, a straggler that is F times slower
  (reft_ext/cluster/stragglers.py; its ``[FAULT]`` line comes once, at ITER). The
  slowness is the machine's: a process the in-process supervisor starts for the rank in
  a later generation (a spare swapped in by ``--reft-replace-stragglers``, a crash's
  replacement) is not slow.

With SIGNAL ``CONT`` (a signal that does not stop the process) a corrupt mode only
corrupts: the rank trains on, and the damage lies in host memory until a later
recovery reads it (two corruptions on two ranks, one kill: no race between them).

This module is the grammar (:func:`parse_fault_spec`, :func:`format_fault_spec`), which
phases a run can reach (:func:`check_fault_phases`) and the attempt a process is on
(:func:`attempt`); reft_ext/testing/fault_observer.py fires the specs. The trainer
validates its ``--inject-*`` flags with these parsers (megatron/training/argument_validation.py
turns a :class:`FaultSpecError` into its flag error).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

CORRUPT_MODES = ("corrupt", "corrupt-replica", "corrupt-manifest", "corrupt-committed")
CORRUPT_SEND = "corrupt-send"  # a payload of REFT-load flipped on its way (no signal)
SLOW = "slow"  # a straggler: the fifth field is its factor (not an attempt)
MODES = ("", "node", "snapshot", "shm-full", CORRUPT_SEND, SLOW, *CORRUPT_MODES)

# the moments, in the order of an iteration (docstring above)
SEAM_PHASES = ("forward", "backward", "send", "recv")  # through megatron-core's timers
SAVE_PHASES = ("save", "save-tracker", "save-done", "save-async")
TRAINER_PHASES = (*SEAM_PHASES, "step", *SAVE_PHASES, "health", "join", "data")
LIBRARY_PHASES = ("has-copy", "snapshot-write", "commit", "aor", "load-read",
                  "load-exchange", "load-rebuild", "flush", "on-start")
# moments of a start (or an in-process restart's rejoin): ITER 0 allowed (a fresh start)
START_PHASES = ("health", "join", "data", "on-start")
PHASES = (*TRAINER_PHASES, *LIBRARY_PHASES)
DEFAULT_PHASE = "step"

GRAMMAR = "RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]][@PHASE]"


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    signal: int = signal.SIGKILL
    mode: str = ""
    attempt: int = 0
    phase: str = DEFAULT_PHASE
    factor: float = 0.0  # mode slow: how many times slower

    def __str__(self) -> str:
        return format_fault_spec(self)


class FaultSpecError(ValueError):
    """A bad ``--inject-fault`` / ``--inject-spike`` value, or a phase this run never
    reaches; the message names the flag."""


def _err(msg: str) -> FaultSpecError:
    return FaultSpecError(f"--inject-fault: {msg}")


def parse_fault_spec(spec: str, world_size: int | None = None) -> FaultSpec:
    """Parse one ``RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]][@PHASE]`` (SIGNAL as a name like
    SIGKILL/KILL/TERM or a number). ``MODE`` snapshot is read as ``@snapshot-write``."""
    body, at, phase = spec.partition("@")
    if at and not phase:
        raise _err(f"empty phase after '@' in {spec!r}; phases: {', '.join(PHASES)}")
    phase = phase.strip() if at else DEFAULT_PHASE
    if phase not in PHASES:
        raise _err(f"unknown phase {phase!r} in {spec!r}; phases: {', '.join(PHASES)}")
    parts = body.split(":")
    if len(parts) not in (2, 3, 4, 5):
        raise _err(f"expected {GRAMMAR}, got {spec!r}")
    mode = parts[3] if len(parts) >= 4 else ""
    attempt = parts[4] if len(parts) == 5 else "0"
    factor = 0.0
    if mode == SLOW:  # RANK:ITER:CONT:slow[:F]
        try:
            factor = float(parts[4]) if len(parts) == 5 else 2.0
        except ValueError:
            raise _err(f"slow's factor F must be a number > 1, got {parts[4]!r}") from None
        if not 1.0 < factor <= 1000.0:
            raise _err(f"slow's factor F must be > 1 (and at most 1000), got {factor:g}")
        if at:
            raise _err(f"mode slow has no phase (it slows every iteration from ITER on): "
                       f"drop @{phase} in {spec!r}")
        attempt = "0"
    if not attempt.isdigit():
        raise _err(f"ATTEMPT must be an integer, got {attempt!r}")
    if mode not in MODES:
        raise _err(f"unknown mode {mode!r} ({', '.join(m for m in MODES if m)})")
    if mode == CORRUPT_SEND and phase not in ("health", "load-read"):
        raise _err(f"mode {CORRUPT_SEND} arms the next REFT-load send: use @load-read "
                   f"(or @health), not {phase!r} (in {spec!r})")
    if mode == "snapshot":
        if at and phase != "snapshot-write":
            raise _err(f"mode snapshot is the phase snapshot-write, not {phase!r} "
                       f"(in {spec!r})")
        phase = "snapshot-write"
    try:
        rank, iteration = int(parts[0]), int(parts[1])
    except ValueError:
        raise _err(f"RANK and ITER must be integers, got {spec!r}") from None
    sig = signal.SIGKILL
    if len(parts) >= 3 and parts[2]:
        name = parts[2].upper()
        try:
            sig = signal.Signals(int(name)) if name.isdigit() else \
                signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise _err(f"unknown signal {parts[2]!r}") from None
    if rank < 0 or (world_size is not None and rank >= world_size):
        raise _err(f"rank {rank} is outside the world of {world_size} ranks")
    lowest = 0 if phase in START_PHASES else 1  # the iteration started (resumed) from
    if iteration < lowest:
        raise _err(f"iteration must be >= {lowest}"
                   f"{'' if lowest == 0 else ' (0 only with @' + '/@'.join(START_PHASES) + ')'}"
                   f", got {iteration}")
    return FaultSpec(rank, iteration, int(sig), "" if mode == "snapshot" else mode,
                     int(attempt), phase, factor)


def parse_fault_specs(text: str, world_size: int | None = None) -> list[FaultSpec]:
    return [parse_fault_spec(p.strip(), world_size) for p in text.split(",") if p.strip()]


def format_fault_spec(spec: FaultSpec) -> str:
    """The spec as ``--inject-fault`` reads it back (``parse_fault_spec`` round trip)."""
    if spec.mode == SLOW:
        return f"{spec.rank}:{spec.iteration}:CONT:{SLOW}:{spec.factor:g}"
    out = f"{spec.rank}:{spec.iteration}:{signal.Signals(spec.signal).name}:{spec.mode}" \
          f":{spec.attempt}"
    return out if spec.phase == DEFAULT_PHASE else f"{out}@{spec.phase}"


def check_fault_phases(specs, args) -> None:
    """Refuse a phase that this run can never reach (a fault that would silently never
    fire): p2p without pipeline parallelism, a save phase without --save, ..."""
    for spec in specs:
        p, why = spec.phase, None
        if p in ("send", "recv") and getattr(args, "pipeline_model_parallel_size", 1) <= 1:
            why = "needs pipeline parallelism (--pipeline-model-parallel-size > 1)"
        elif p in SAVE_PHASES and not getattr(args, "save", None):
            why = "needs --save (a persistent checkpoint being written)"
        elif p == "save-async" and not getattr(args, "async_save", False):
            why = "needs --async-save"
        elif p in LIBRARY_PHASES and not getattr(args, "reft_snapshot_every", 0):
            why = "needs REFT snapshots (--reft-snapshot-every N)"
        elif p == "flush":  # the node watcher is a process of its own, not a rank
            why = ("is the node watcher's, a process of its own: set "
                   "REFT_WATCHER_FAULT=flush:NODE[:ATTEMPT] in the workers' environment "
                   "(reft_ext/cluster/watcher.py) instead")
        elif p == "has-copy" and getattr(args, "reft_schedule", "has") == "end-of-iteration":
            why = ("needs a background snapshot copy (--reft-schedule has or host-thread; "
                   "end-of-iteration copies inline)")
        elif p == "aor" and "aor" not in str(getattr(args, "reft_protect", "")).split(","):
            why = "needs AOR (--reft-protect ...,aor)"
        elif p == "health":
            from reft_ext.cluster.health_config import HealthConfig

            if not HealthConfig.from_args(args).enabled(args.reft_snapshot_every):
                why = ("needs the start-up health check (--reft-health-check on, or auto "
                       "with --reft-snapshot-every N)")
        if why:
            raise _err(f"{format_fault_spec(spec)}: phase {p} {why}")


def attempt() -> int:
    """The job's attempt as this rank sees it. A replacement agent started by
    tools/launch_nodes.py counts its restarts from 0 again: the launcher passes how many
    agents of that node slot came before (REFT_NODE_GENERATION), so a fault meant for
    attempt 0 does not fire again on the node that replaced the failed one."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) +
            int(os.environ.get("REFT_NODE_GENERATION", "0")) +
            int(os.environ.get("REFT_GENERATION", "0")))  # in-process restarts


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
            raise FaultSpecError(f"--inject-spike: expected RANK:ITER[:scale|nan], got "
                                 f"{part!r}")
        rank, iteration = int(bits[0]), int(bits[1])
        if world_size is not None and rank >= world_size:
            raise FaultSpecError(f"--inject-spike: rank {rank} is outside the world of "
                                 f"{world_size} ranks")
        if iteration < 1:
            raise FaultSpecError(f"--inject-spike: iteration must be >= 1, got {iteration}")
        out.append(SpikeSpec(rank, iteration, kind))
    return out
