"""Hierarchical Asynchronous Snapshotting: a snapshot thread that copies the state of
iteration i, chunk by chunk, while iteration i+1 runs its forward and backward passes.

Consistency: forward and backward do not write parameters or optimizer state (only
gradients and activations), so the state of iteration i stands still until the optimizer
step of iteration i+1; the trainer calls :meth:`HasWorker.drain` right before that step
and whatever is left is copied then (that wait is the snapshot's overhead).

Tiers (Algorithm 1 in docs/design.md, ``reft_ext/save/bubbles.py``): the first ``bubble_bytes`` of the
snapshot are tier 1 and are copied only while the rank waits on pipeline communication
(the schedule's p2p waits, reported through :class:`reft_ext.report.timeline.PipelineEvents`);
the rest is tier 2 and is copied concurrently with compute, one small chunk at a time.
A tier-1 chunk never competes with compute, a tier-2 chunk does, briefly. Tier 3
(copying during communication) pays only where the snapshot and the training traffic use
different links (PCIe vs NVLink/IB); on a CPU both are the memory bus, so it is not used.

The ``host-thread`` baseline is the same thread with everything in tier 2: it copies the
whole snapshot as soon as it is handed over, unaware of the schedule.

Every unit of work (copy or XOR-encode one chunk into shared memory, then hash it) runs
in torch/native/xxhash code that releases the GIL; the thread holds the GIL only to
pick the next chunk.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from reft_ext.report.threads import join_or_warn
from reft_ext.report.timeline import Trace, now_us
from reft_ext.state.regions import Region
from reft_ext.testing import fault_point  # the one test injection point (no-op in production)

TIER1, TIER2 = 1, 2


@dataclass
class Unit:
    """One chunk: ``run()`` fills it and returns its digest."""

    region: Region
    index: int
    nbytes: int
    run: Callable[[], int]
    tier: int = TIER2
    # units of one region sharing ``batch`` run together, one call for several
    # (batch(units, how) -> their digests: the native copy-and-hash pipeline)
    batch: Callable[[list["Unit"], str], list[int]] | None = None


def same_batch(a: Unit, b: Unit) -> bool:
    return a.batch is not None and a.batch is b.batch


def run_units(units: list[Unit], how: str) -> list[int]:
    """Digests of ``units`` (one region's, or one unit): one batch call, or run()."""
    if units[0].batch is not None:
        return units[0].batch(units, how)
    return [u.run() for u in units]


@dataclass
class Batch:
    """The units of one snapshot and what became of them."""

    units: list[Unit]
    iteration: int
    digests: dict[Region, dict[int, int]] = field(default_factory=dict)
    done: int = 0
    by_how: dict[str, int] = field(default_factory=lambda: {"bubble": 0, "compute": 0,
                                                           "drain": 0})
    busy_s: float = 0.0  # time spent running units
    slot: int = -1
    t0: float = 0.0
    meta: dict | None = None
    split: object = None
    fault_checked: bool = False
    sums: dict | None = None  # the regions' checksums, once sealed (early_seal.py)
    agreement: object = None  # the job-wide commit's all-reduce, once posted

    @property
    def finished(self) -> bool:
        return self.done == len(self.units)


class HasWorker:
    """The snapshot thread of one rank; also a PipelineEvents listener."""

    def __init__(self, trace: Trace, on_error: Callable[[BaseException], None] | None = None):
        self.trace = trace
        # called on this thread with a batch whose last units it just ran, before the
        # batch reads finished (the snapshotter's early seal: reft_ext/save/early_seal.py)
        self.on_done: Callable[[Batch], None] | None = None
        self._cv = threading.Condition()
        self._batch: Batch | None = None
        self._next = 0           # first unit not yet started (units run in list order ...)
        self._skipped: list[int] = []  # ... except tier-1 units passed over outside bubbles
        self._bubble = False
        self._draining = False
        self._closed = False
        self._error: BaseException | None = None
        self._on_error = on_error
        self._thread = threading.Thread(target=self._loop, name="reft-has", daemon=True)
        self._thread.start()

    # ---- the trainer's side -------------------------------------------------------------
    def submit(self, batch: Batch) -> None:
        with self._cv:
            if self._batch is not None and not self._batch.finished:
                raise RuntimeError("HAS: a snapshot is still in flight")
            self._batch, self._next, self._skipped = batch, 0, []
            self._draining = False
            self._cv.notify_all()

    def drain(self) -> float:
        """Copy whatever is left now; returns the seconds the caller waited."""
        t0 = time.perf_counter()
        with self._cv:
            if self._batch is None:
                return 0.0
            self._draining = True
            self._cv.notify_all()
            while not self._batch.finished and self._error is None:
                self._cv.wait()
            self._draining = False
            if self._error is not None:
                raise RuntimeError("HAS snapshot thread failed") from self._error
        return time.perf_counter() - t0

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the thread; False (and a warning said) when a unit it runs outlasts
        ``timeout_s``: it may still be writing into the slot."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return join_or_warn(self._thread, timeout_s, "the HAS snapshot thread")

    # ---- PipelineEvents listener (called on the training thread) -------------------------
    def wait_begin(self, name: str) -> None:
        with self._cv:
            self._bubble = True
            # woken only with work left for a bubble: a wake-up that finds none was two
            # context switches of every p2p wait (issue 57)
            b = self._batch
            if b is not None and (self._skipped or self._next < len(b.units)):
                self._cv.notify_all()

    def wait_end(self, name: str) -> None:
        self._bubble = False  # read by the thread between chunks; no need to wake it

    # ---- the thread ----------------------------------------------------------------------
    # most units one call takes: a bubble's one (4 MiB, ~1-2 ms: its end is heard between
    # calls, so a copy overruns the wait by at most one chunk and the rank's compute is
    # not delayed by a long call; issue 57); beside compute 256 MiB (the copy engine idles
    # only between calls); a drain's, all
    GROUP = {"bubble": 1, "compute": 64}

    def _pick(self) -> tuple[list[Unit], str]:
        b = self._batch
        if b is None:
            return [], ""
        how = "drain" if self._draining else ("bubble" if self._bubble else "compute")
        limit = self.GROUP.get(how, len(b.units))
        if how != "compute" and self._skipped:
            units = [b.units[self._skipped.pop(0)]]
            while self._skipped and len(units) < limit and \
                    same_batch(units[-1], b.units[self._skipped[0]]):
                units.append(b.units[self._skipped.pop(0)])
            return units, how
        units: list[Unit] = []
        while self._next < len(b.units):
            i = self._next
            u = b.units[i]
            if units and (len(units) >= limit or not same_batch(units[-1], u)):
                break
            self._next += 1
            if u.tier == TIER1 and how == "compute":
                self._skipped.append(i)  # waits for a bubble (or the drain)
                continue
            units.append(u)
            if u.batch is None:
                break
        return units, how

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    units, how = self._pick()
                    if units:
                        break
                    self._cv.wait()
                batch = self._batch
            t0 = now_us()
            try:
                digests = run_units(units, how)
                if batch.done == 0:  # the batch's first units copied, the rest not yet
                    fault_point("has-copy", iteration=batch.iteration, how=how)
            except BaseException as e:  # noqa: BLE001 - reported to the trainer at drain
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                if self._on_error:
                    self._on_error(e)
                return
            t1 = now_us()
            nbytes = sum(u.nbytes for u in units)
            first = units[0]
            name = f"{first.region}[{first.index}]" if len(units) == 1 else \
                f"{first.region}[{first.index}..{units[-1].index}]"
            self.trace.complete(name, f"snapshot-{how}", t0, t1, tid="snapshot",
                                iteration=batch.iteration, tier=first.tier, bytes=nbytes)
            with self._cv:
                for u, digest in zip(units, digests):
                    batch.digests.setdefault(u.region, {})[u.index] = digest
                batch.by_how[how] += nbytes
                batch.busy_s += (t1 - t0) / 1e6
                last = batch.done + len(units) == len(batch.units)
            if last and self.on_done is not None:
                self.on_done(batch)  # (its own errors leave the seal to the step)
            with self._cv:
                batch.done += len(units)
                if batch.finished:
                    self._cv.notify_all()
