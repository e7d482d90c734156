"""When a fault of ``--inject-fault`` fires, and the ``--inject-spike`` gradients (the
specs, their phases and modes: reft_ext/testing/fault_specs.py).

:func:`install` puts one :class:`FaultObserver` behind
:func:`reft_ext.testing.fault_point` on every rank named in ``--inject-fault`` (REFT on or
off); a plain run installs nothing and every fault point costs one ``None`` test. The
REFT part of a mode (wiping, corrupting) is reft_ext/testing/faults.py's
:class:`~reft_ext.testing.faults.ReftFaults`, which the observer delegates to once REFT's
session is open. The trainer reaches this module through one seam,
megatron/training/fault_injection.py.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from reft_ext.testing import fault_point, get_fault_observer, set_fault_observer
from reft_ext.testing.fault_specs import (CORRUPT_MODES, CORRUPT_SEND, SLOW, SPIKE_SCALE,
                                         FaultSpec, attempt)

# fault points that are requests to REFT's ReftFaults, not moments
REFT_POINTS = ("node-loss", "corrupt")
SHM_RESERVE = "shm-reserve"  # reft_ext/store/shm.py, before posix_fallocate
LOAD_SEND = "load-send"  # reft_ext/load/received.py, a payload about to go to a peer
SLOW_FACTOR = "slow-factor"  # reft_ext/cluster/stragglers.py, before each gradient sync


def emit(msg: str) -> None:
    """One line in one write (as the trainer's ``emit``): ranks share torchrun's pipe."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


class FaultObserver:
    """The one observer of :func:`reft_ext.testing.fault_point` on a rank named in
    ``--inject-fault``. ``observer(point, iteration=IT, **info)``:

    * ``point`` one of PHASES: fires every spec of this rank with that phase and
      iteration on this attempt (``info["attempt"]`` overrides the process's, the health
      check passes the job-wide one), each at most once per process;
    * ``point`` one of REFT_POINTS ("node-loss", "corrupt"): handed to ``self.reft`` (a
      :class:`reft_ext.testing.faults.ReftFaults`, set when REFT's session opens);
    * ``point`` "shm-reserve" (reft_ext/store/shm.py): raises ENOSPC once after a
      ``shm-full`` fault fired;
    * ``point`` "load-send" (reft_ext/load/received.py): after a ``corrupt-send``
      fault fired, returns the payload's copy with one byte flipped;
    * anything else: ignored.
    """

    def __init__(self, specs, rank: int):
        self.rank = rank
        self.specs = [s for s in specs if s.rank == rank]
        self.fired: set[FaultSpec] = set()
        self.reft = None          # ReftFaults, once REFT's session is open
        self.shm_full = False     # the next shared-memory reservation fails (shm-full)
        self.flip_send = False    # REFT-load payloads sent are damaged (corrupt-send)
        # a process the in-process supervisor started for a later generation took the
        # rank over (on a cluster: another machine, a swap's spare): the slowness of a
        # ``slow`` fault was the machine's it replaced, not the rank's
        self.replacement = int(os.environ.get("REFT_GENERATION", "0") or 0) > 0

    def wants(self, phase: str, att: int | None = None) -> bool:
        """Is a spec of this phase still to fire (on attempt ``att``, default this
        process's)? Lets a caller skip work done only to name the iteration."""
        att = attempt() if att is None else att
        return any(s.phase == phase and s.attempt == att and s not in self.fired
                   for s in self.specs)

    def __call__(self, point: str, iteration: int | None = None, **info) -> None:
        if point in REFT_POINTS:
            if self.reft is not None:
                self.reft(point, iteration=iteration, **info)
            return
        if point == SHM_RESERVE:
            if self.shm_full:
                self.shm_full = False
                raise OSError(errno.ENOSPC, f"[FAULT] injected: no space left on the "
                                            f"shared-memory filesystem ({info.get('path')})")
            return
        if point == LOAD_SEND:
            return self.damaged(iteration, **info) if self.flip_send else None
        if point == SLOW_FACTOR:
            return self.slow_factor(iteration)
        att = info.get("attempt")
        att = attempt() if att is None else att
        for spec in self.specs:
            if spec.phase == point and spec.iteration == iteration and \
                    spec.attempt == att and spec not in self.fired and spec.mode != SLOW:
                self.fired.add(spec)
                self.fire(spec)

    def slow_factor(self, iteration) -> float | None:
        """Mode ``slow``: the factor of a spec whose ITER is reached (any attempt: a slow
        node stays slow; not in a replacement process), its ``[FAULT]`` line and event
        the first time."""
        for spec in self.specs if not self.replacement else ():
            if spec.mode == SLOW and iteration is not None and iteration >= spec.iteration:
                if spec not in self.fired:
                    self.fired.add(spec)
                    emit(f"[FAULT] slowing rank {spec.rank} (pid {os.getpid()}) "
                         f"{spec.factor:g}x from iteration {iteration}: a sleep of "
                         f"{spec.factor - 1:g}x its forward-backward compute before each "
                         f"gradient sync")
                    from reft_ext.report.events import record

                    record("fault", iteration=iteration, phase="step", signal=None,
                           mode=SLOW, factor=spec.factor)
                return spec.factor
        return None

    def damaged(self, iteration, payload, what: str, to: int):
        """A copy of ``payload`` with its middle byte flipped (``corrupt-send``)."""
        out = payload.clone()
        out[out.numel() // 2] ^= 0xFF
        peer = "its group" if to < 0 else f"rank {to}"
        emit(f"[FAULT] flipped a byte of {what} rank {self.rank} sends to {peer} while "
             f"restoring iteration {iteration} (in transit; its snapshot is intact)")
        return out

    def fire(self, spec: FaultSpec) -> None:
        where = f"at iteration {spec.iteration}, phase {spec.phase}" + \
            (" (during its snapshot write)" if spec.phase == "snapshot-write" else "")
        if spec.mode == "shm-full":
            self.shm_full = True
            emit(f"[FAULT] shared memory full for rank {spec.rank} (pid {os.getpid()}) "
                 f"{where}: its next space reservation fails with ENOSPC")
            sys.stdout.flush()
            return
        if spec.mode == CORRUPT_SEND:
            self.flip_send = True
            emit(f"[FAULT] rank {spec.rank} (pid {os.getpid()}) {where}: every payload it "
                 f"sends from now on during a REFT-load is flipped in transit")
            return
        if spec.mode == "node":  # REFT (if on) wipes the failure domain's shared memory
            fault_point("node-loss", iteration=spec.iteration)
        if spec.mode in CORRUPT_MODES:  # REFT (if on) damages the last committed snapshot
            fault_point("corrupt", iteration=spec.iteration, mode=spec.mode)
        name = signal.Signals(spec.signal).name
        emit(f"[FAULT] injecting {name} into rank {spec.rank} (pid {os.getpid()}) {where}"
             f"{' (node loss)' if spec.mode == 'node' else ''}")
        from reft_ext.report.events import record  # the moment, for downtime figures

        record("fault", iteration=spec.iteration, phase=spec.phase, signal=name,
               mode=spec.mode)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), spec.signal)
        # a catchable signal (SIGTERM with --exit-signal-handler) lets the process go on;
        # give the handler a moment to run before training continues
        time.sleep(0.1)


def install(specs, rank: int) -> FaultObserver | None:
    """Put this rank's observer behind fault_point when ``--inject-fault`` names it
    (REFT on or off); None (nothing installed: fault points stay free) otherwise."""
    if not any(s.rank == rank for s in specs or ()):
        return None
    obs = FaultObserver(specs, rank)
    set_fault_observer(obs)
    return obs


def observer() -> FaultObserver | None:
    """The installed observer of this process, if it is ours."""
    obs = get_fault_observer()
    return obs if isinstance(obs, FaultObserver) else None


def wants(phase: str, att: int | None = None) -> bool:
    """Does this rank have a fault of ``phase`` still to fire? (False without one)."""
    obs = observer()
    return obs is not None and obs.wants(phase, att)


def maybe_inject_fault(specs, rank: int, iteration: int) -> None:
    """The ``step`` moment, before the optimizer step of ``iteration`` (the trainer
    calls ``fault_point("step", ...)``; this is the same for callers holding specs)."""
    obs = observer()
    if obs is None and any(s.rank == rank for s in specs or ()):
        obs = install(specs, rank)
    fault_point("step", iteration=iteration)


def fire(spec: FaultSpec, when: str = "") -> None:
    """Fire ``spec`` now on this rank (if the attempt matches), whatever its phase."""
    if attempt() != spec.attempt:
        return
    (observer() or FaultObserver([spec], spec.rank)).fire(spec)


# ---- loss spikes (tests of --reft-rollback-on) -----------------------------------------
def maybe_inject_spike(specs, rank: int, iteration: int, model, fired: set) -> None:
    """Before ``iteration``'s optimizer step: this rank's gradients (megatron's main_grad,
    which the optimizer reads) scaled by SPIKE_SCALE or made NaN; each spec fires once per
    process, so the iteration redone after the rollback runs clean."""
    import torch

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
