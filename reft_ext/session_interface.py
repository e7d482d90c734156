"""What a training loop calls and hands in, whether REFT is on or off: the ``Session``
interface, the ``SessionAdapter`` and ``LoopState`` a session reads, and
``DisabledSession``, the interface doing nothing (``--reft-snapshot-every 0``).

Apart from :class:`~reft_ext.session.ReftSession` so that the contract a trainer codes
against (and that ``tests/unit/test_session_interface.py`` holds both sessions to) reads
on its own, beside its one implementation that does nothing, not between the hooks of
the one that does. The Chrome trace of ``--reft-trace-file`` (:class:`_Trace`) is here
too: both sessions write it. ``reft_ext.session`` re-exports every name, the way
trainers import them.
"""

from __future__ import annotations

import abc
import contextlib
import os
from typing import Protocol

import torch

from reft_ext.load.rollback import RollbackError
from reft_ext.report.events import emit as reft_emit
from reft_ext.save.snapshotter import StateAdapter


class SessionAdapter(StateAdapter, Protocol):
    """The snapshotter's :class:`StateAdapter` plus what the session itself needs."""

    global_batch_size: int   # samples per iteration (a rollback skips whole batches)
    # optional: the groups the loss-spike verdict is agreed over (default: the whole job)
    # verdict_groups: list

    def identity(self) -> dict: ...  # what makes a state this run's (state/identity.py)


class LoopState(Protocol):
    """The trainer's state as the hook methods read it."""

    iteration: int                 # iterations completed
    consumed_train_samples: int    # the data position (a rollback moves it on)
    extra: dict                    # small JSON part, in every snapshot (REFT's counters)
    report: dict                   # this iteration's {"loss": ..., "grad_norm": ...}


class Session(abc.ABC):
    """What the trainer calls, whether REFT is on (:class:`ReftSession`) or off
    (:class:`DisabledSession`): one interface, so no call site asks which it holds.
    ``tests/unit/test_session_interface.py`` checks that both implement all of it with
    the same signatures."""

    enabled: bool

    @abc.abstractmethod
    def recover(self, persistent_iteration: int | None) -> int | None: ...
    @abc.abstractmethod
    def count_recovery(self, tier: str) -> None: ...
    @abc.abstractmethod
    def recovered_from_checkpoint(self, path: str) -> None: ...
    @abc.abstractmethod
    def on_start(self, state) -> None: ...
    @abc.abstractmethod
    def before_optimizer_step(self, state) -> None: ...
    @abc.abstractmethod
    def after_step(self, state) -> None: ...
    @abc.abstractmethod
    def rollback(self, state, reason: str) -> None: ...
    @abc.abstractmethod
    def take_peer_wait(self) -> float:
        """Seconds the hooks waited for peers since the last call (goodput: productive)."""
    @abc.abstractmethod
    def heartbeat_paused(self): ...
    @abc.abstractmethod
    def pause_heartbeat(self) -> None: ...
    @abc.abstractmethod
    def on_exit(self, state) -> None: ...
    @abc.abstractmethod
    def commit_in_flight(self) -> None:
        """Finish and commit the snapshot in flight now (collective: every rank calls
        it at the same iteration; a straggler swap takes its restart right after)."""
    @abc.abstractmethod
    def abandon(self) -> None:
        """This generation failed (in-process restart): stop without committing."""
    @abc.abstractmethod
    def close(self) -> None: ...
    @abc.abstractmethod
    def release_start(self) -> None: ...
    @abc.abstractmethod
    def summary(self, state) -> str: ...
    @abc.abstractmethod
    def write_trace(self) -> None: ...


class _Trace:
    """The Chrome trace of ``--reft-trace-file`` (with or without snapshots)."""

    def __init__(self, trace_file: str = "", events=None, trace_group=None):
        self.trace_file, self.events, self.trace_group = trace_file, events, trace_group

    def write_trace(self) -> None:
        """Collective: every rank's events to rank 0, one Chrome trace file."""
        if not self.trace_file or self.events is None:
            return
        from reft_ext.report.timeline import write_chrome_trace

        tr = self.events.trace
        world = torch.distributed.get_world_size()
        gathered = [None] * world if tr.rank == 0 else None
        torch.distributed.gather_object((tr.chrome_events(), tr.dropped), gathered, dst=0,
                                        group=self.trace_group)
        if tr.rank == 0:
            write_chrome_trace(self.trace_file, [g[0] for g in gathered],
                               sum(g[1] for g in gathered))
            path = os.path.abspath(self.trace_file)
            reft_emit("trace", f"trace of {world} ranks written to {path}", ranks=world,
                      path=path)


class DisabledSession(_Trace, Session):
    """REFT off (``--reft-snapshot-every 0``): the session's interface, doing nothing
    (but the trace, which ``--reft-trace-file`` asks for without snapshots too)."""

    enabled = False
    snap = None

    def recover(self, persistent_iteration: int | None) -> int | None:
        return None

    def count_recovery(self, tier: str) -> None:
        pass

    def recovered_from_checkpoint(self, path: str) -> None:
        pass

    def on_start(self, state) -> None:
        pass

    def before_optimizer_step(self, state) -> None:
        pass

    def after_step(self, state) -> None:
        pass

    def rollback(self, state, reason: str) -> None:
        raise RollbackError(f"rollback ({reason}) needs --reft-snapshot-every >= 1")

    def take_peer_wait(self) -> float:
        return 0.0

    def heartbeat_paused(self):
        return contextlib.nullcontext()

    def pause_heartbeat(self) -> None:
        pass

    def on_exit(self, state) -> None:
        pass

    def commit_in_flight(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass

    def release_start(self) -> None:
        pass

    def summary(self, state) -> str:
        return ""
