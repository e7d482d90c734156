"""When a snapshot's units run (``--reft-schedule``), picked once from the config.

* :class:`EndOfIteration`: all units now, right after the optimizer step; training waits.
* :class:`HostThread`: a background thread runs every unit as soon as the snapshot is
  handed over, unaware of the pipeline schedule (everything tier 2: the baseline).
* :class:`HAS`: the same thread, but the first part of the snapshot (Algorithm 1,
  reft_ext/save/tiers.py) waits for pipeline bubbles; it hears them as a
  PipelineEvents listener. See reft_ext/save/has.py.

Whatever a threaded schedule has not copied when the next optimizer step comes is
copied at :meth:`Schedule.drain`, which the snapshotter calls before that step.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from reft_ext.report.timeline import PipelineEvents
from reft_ext.save.has import Batch, HasWorker, run_units, same_batch
from reft_ext.save.tiers import Bandwidth, bubble_estimate, plan_tiers


class Schedule(ABC):
    """Every schedule is built the same way (:func:`make_schedule`); the inputs of
    Algorithm 1 matter only to the threaded ones."""

    name = "abstract"
    span = "snapshot-handover"  # what the trace calls the hand-over on the training thread
    inline = False              # True: a snapshot is complete when submit returns

    def __init__(self, events: PipelineEvents, bandwidth: Bandwidth,
                 pipeline: tuple[int, int, int], concurrent: bool, device: bool = False):
        self.events, self.bandwidth = events, bandwidth
        self.pipeline, self.concurrent = pipeline, concurrent  # (pp, vpp, micro-batches)
        self.device = device  # device state: D2H on the copy engine (tiers.plan_tiers)

    @abstractmethod
    def submit(self, batch: Batch) -> None:
        """Take a snapshot's units (metadata captured, slot open)."""

    def drain(self) -> float:
        """Run whatever is left of the submitted snapshot now; the seconds waited."""
        return 0.0

    def close(self) -> None:
        pass


def run_inline(batch: Batch) -> None:
    """Every unit now, in order, on the calling thread (all bytes count as "drain")."""
    t0 = time.perf_counter()
    i, units = 0, batch.units
    while i < len(units):  # one call per region where its units share a batch
        j = i + 1
        while j < len(units) and same_batch(units[i], units[j]):
            j += 1
        for u, digest in zip(units[i:j], run_units(units[i:j], "drain")):
            batch.digests.setdefault(u.region, {})[u.index] = digest
        i = j
    batch.done = len(batch.units)
    batch.by_how["drain"] = sum(u.nbytes for u in batch.units)
    batch.busy_s = time.perf_counter() - t0


class EndOfIteration(Schedule):
    """A blocking copy after the optimizer step."""

    name = "end-of-iteration"
    span = "snapshot-copy"
    inline = True

    def submit(self, batch: Batch) -> None:
        run_inline(batch)


class HostThread(Schedule):
    """A snapshot thread copies the whole snapshot at once, beside compute."""

    name = "host-thread"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worker = HasWorker(self.events.trace)

    def plan(self, batch: Batch) -> None:
        plan_tiers(batch, self.bandwidth.value, 0.0, self.concurrent, everything_tier2=True)

    def submit(self, batch: Batch) -> None:
        self.plan(batch)
        self.worker.submit(batch)

    def drain(self) -> float:
        return self.worker.drain()

    def close(self) -> None:
        self.worker.close()


class HAS(HostThread):
    """Hierarchical asynchronous snapshotting: bubbles first, the rest beside compute
    (``concurrent``) or at the drain."""

    name = "has"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events.listeners.append(self.worker)  # bubbles begin and end on its cue

    def plan(self, batch: Batch) -> None:
        plan_tiers(batch, self.bandwidth.value,
                   bubble_estimate(self.events.profile, self.pipeline), self.concurrent,
                   device=self.device)

    def close(self) -> None:
        if self.worker in self.events.listeners:
            self.events.listeners.remove(self.worker)
        super().close()


SCHEDULES: dict[str, type[Schedule]] = {c.name: c for c in (HAS, EndOfIteration, HostThread)}


def make_schedule(name: str, events: PipelineEvents, bandwidth: Bandwidth,
                  pipeline: tuple[int, int, int], concurrent: bool,
                  device: bool = False) -> Schedule:
    """The schedule ``--reft-schedule`` names (ReftConfig checks the name)."""
    return SCHEDULES[name](events, bandwidth, pipeline, concurrent, device)
