"""What the pipeline schedule is doing, as events: the bus the HAS scheduler listens to
and the Chrome trace (``--reft-trace-file``, opens in Perfetto / chrome://tracing).

The trainer's thin seams (megatron/training/pipeline_events.py) report:

* ``phase_begin/phase_end(name)``: compute phases of the schedule (``forward-compute``,
  ``backward-compute``), the optimizer step, a snapshot's drain and commit;
* ``wait_begin/wait_end(name)``: the rank is blocked on pipeline communication (a p2p
  recv/send of the schedule): a bubble, time the rank's core is idle;
* ``step_begin/step_end(iteration)``: the training forward-backward of one iteration
  (evaluation passes are not steps, so they do not feed the bubble profile).

Listeners (the HAS worker) get ``wait_begin/wait_end`` synchronously; the profiler keeps,
per step, the total wait time and the compute time per micro-batch, which is what
Algorithm 1's T_bubble estimates come from.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from statistics import median

from reft_ext.report.files import replace_with

MAX_EVENTS = 500_000  # a trace past this is cut (a note says so), memory stays bounded


def now_us() -> float:
    """Wall-clock microseconds: ranks on one host (or NTP-synced nodes) line up."""
    return time.time_ns() / 1000.0


class Trace:
    """Complete events ("ph": "X") of one rank; thread-safe append."""

    def __init__(self, rank: int, enabled: bool):
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self.labels = {"process": f"rank {rank}", "threads": {}}

    def complete(self, name: str, cat: str, t0_us: float, t1_us: float, tid: str = "train",
                 **args) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "cat": cat, "ph": "X", "ts": round(t0_us, 1),
              "dur": round(max(0.0, t1_us - t0_us), 1), "pid": self.rank, "tid": tid}
        if args:
            ev["args"] = args
        with self._lock:
            if len(self.events) < MAX_EVENTS:
                self.events.append(ev)
            else:
                self.dropped += 1

    def chrome_events(self) -> list[dict]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": self.labels["process"]}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        for tid, order in (("train", 0), ("snapshot", 1)):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"name": tid}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank,
                         "tid": tid, "args": {"sort_index": order}})
        return meta + self.events


def write_chrome_trace(path: str, per_rank: list[list[dict]], dropped: int = 0) -> None:
    """One JSON file with every rank's track, written atomically."""
    events = [e for evs in per_rank for e in evs]
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"producer": "reft_ext.report.timeline", "dropped_events": dropped}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_with(path, json.dumps(doc))  # a fresh O_EXCL|O_NOFOLLOW temporary, renamed


class StepProfile:
    """Per training step: total wait (bubble) time and compute time per micro-batch."""

    def __init__(self, keep: int = 8):
        self.waits: deque[float] = deque(maxlen=keep)     # seconds per step
        self.computes: deque[float] = deque(maxlen=keep)  # seconds per step
        self.wait_s = self.compute_s = 0.0

    def close_step(self):
        self.waits.append(self.wait_s)
        self.computes.append(self.compute_s)
        self.wait_s = self.compute_s = 0.0

    def bubble(self) -> float | None:
        """Median measured bubble of recent steps (None before the first step)."""
        return median(self.waits) if self.waits else None

    def compute(self) -> float | None:
        return median(self.computes) if self.computes else None


class PipelineEvents:
    """The event bus: seams call it, the trace and the listeners hear it."""

    def __init__(self, rank: int, trace: bool = False):
        self.trace = Trace(rank, trace)
        self.profile = StepProfile()
        self.listeners: list = []   # objects with wait_begin(name) / wait_end(name)
        self.iteration = 0
        self.in_step = False
        self._open: dict[str, float] = {}
        self._wait_t0: float | None = None
        self._wait_name = ""
        # hang detection (reft_ext/cluster/heartbeat.py): beaten at every event below
        self.heartbeat = None

    # ---- compute / named phases --------------------------------------------------
    def phase_begin(self, name: str) -> None:
        self._open[name] = now_us()
        if self.heartbeat is not None:
            self.heartbeat.on_phase(name, True)

    def phase_end(self, name: str, cat: str = "compute", **args) -> None:
        if self.heartbeat is not None:
            self.heartbeat.on_phase(name, False)
        t0 = self._open.pop(name, None)
        if t0 is None:
            return
        t1 = now_us()
        if self.in_step and name in ("forward-compute", "backward-compute"):
            self.profile.compute_s += (t1 - t0) / 1e6
        if self.trace.enabled:  # (a dozen phases per iteration: no arguments built for none)
            self.trace.complete(name, cat, t0, t1, **{"iteration": self.iteration, **args})

    def span(self, name: str, cat: str = "step", **args):
        events = self

        class _Span:
            def __enter__(self):
                events.phase_begin(name)

            def __exit__(self, *exc):
                events.phase_end(name, cat, **args)

        return _Span()

    # ---- waits (bubbles) ------------------------------------------------------------
    def wait_begin(self, name: str) -> None:
        if self._wait_t0 is not None:  # nested (a wrapped req inside _communicate)
            return
        self._wait_t0, self._wait_name = now_us(), name
        if self.heartbeat is not None:
            self.heartbeat.wait()
        for lis in self.listeners:
            lis.wait_begin(name)

    def wait_end(self) -> None:
        if self._wait_t0 is None:
            return
        t0, name = self._wait_t0, self._wait_name
        self._wait_t0 = None
        if self.heartbeat is not None:
            self.heartbeat.wait()  # progress; the next compute phase makes it work again
        for lis in self.listeners:
            lis.wait_end(name)
        t1 = now_us()
        if self.in_step:
            self.profile.wait_s += (t1 - t0) / 1e6
        if self.trace.enabled:
            self.trace.complete(name, "p2p-wait", t0, t1, iteration=self.iteration)

    # ---- steps -------------------------------------------------------------------------
    def step_begin(self, iteration: int) -> None:
        self.iteration, self.in_step = iteration, True
        if self.heartbeat is not None:
            self.heartbeat.step()

    def step_end(self) -> None:
        if self.in_step:
            self.profile.close_step()
        self.in_step = False

    def interrupted(self) -> None:
        """The step in progress was abandoned (an in-process restart): forget its open
        phases and wait; the next session's heartbeat replaces the old one."""
        self.in_step, self._open, self._wait_t0, self.heartbeat = False, {}, None, None
