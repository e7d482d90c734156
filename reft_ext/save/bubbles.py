"""Pipeline bubbles and Algorithm 1's tier split: the arithmetic shared by the HAS
scheduler (which feeds it measured times) and the planner (which feeds it estimates).

Notation: P pipeline stages, m micro-batches per iteration, v model chunks per stage
(interleaved schedule), t_fb = forward + backward time of one micro-batch on the whole
stage (all its chunks).

1F1B: every stage computes for m * t_fb per iteration and the iteration lasts
(m + P - 1) * t_fb, so each stage idles (P - 1) * t_fb: stage p waits p forward times
during warm-up and the rest during cool-down (Narayanan et al., SC'21, eq. 1).
Interleaved with v chunks per stage: the bubble shrinks v times, to (P - 1) * t_fb / v.

Measured bubbles on a GPU (:class:`GpuIdleClock`): a p2p call returns once its
transfer is queued, long before the GPU is idle, so the CPU time inside it is not the
bubble. There the bubble is the GPU time between the CUDA event recorded at the end of
one compute phase and the one recorded at the start of the next, on the compute stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reft_ext.report.timeline import StepProfile
from reft_ext.state.layout import ALIGN  # the tier boundary falls on a cache line


def bubble_time(pp: int, t_fb: float, vpp: int = 1) -> float:
    """Idle seconds per stage per iteration; ``t_fb``: fwd+bwd of one micro-batch on
    the whole stage."""
    if pp < 1 or vpp < 1:
        raise ValueError("pipeline sizes must be >= 1")
    return (pp - 1) * t_fb / vpp


def iteration_time(pp: int, microbatches: int, t_fb: float, vpp: int = 1) -> float:
    """Seconds per iteration of a stage (compute + bubble), communication not counted."""
    return microbatches * t_fb + bubble_time(pp, t_fb, vpp)


@dataclass(frozen=True)
class TierSplit:
    """Algorithm 1: the first ``bubble_bytes`` of the stage's snapshot go into bubbles
    (tier 1), the rest is copied concurrently with compute (tier 2)."""

    nbytes: int
    bubble_bytes: int
    t_snapshot: float
    t_bubble: float

    @property
    def rest_bytes(self) -> int:
        return self.nbytes - self.bubble_bytes


def snapshot_time(nbytes: int, bandwidth: float) -> float:
    """T_snapshot = size / BW_io (bytes, bytes per second)."""
    if bandwidth <= 0:
        raise ValueError("bandwidth must be > 0")
    return nbytes / bandwidth


def tier_split(nbytes: int, t_snapshot: float, t_bubble: float) -> TierSplit:
    """W_bubble = W[:floor(N * T_bubble / T_snapshot)] when the snapshot is longer than
    the bubbles, else everything; the boundary is rounded down to ALIGN bytes."""
    if t_snapshot <= t_bubble or nbytes == 0:
        cut = nbytes
    else:
        cut = int(nbytes * max(0.0, t_bubble) / t_snapshot) // ALIGN * ALIGN
    return TierSplit(nbytes, cut, t_snapshot, t_bubble)


class GpuIdleClock:
    """Compute spans and the idle gaps between them, per step, from CUDA events on the
    current (compute) stream. Events are read only once they have completed
    (``query()``): measuring never waits for the device; a step's numbers come out at
    the first ``close_step`` after its last event completed. ``new_event``: a factory of
    objects with record(), query(), elapsed_time(other) in ms (torch.cuda.Event with
    timing by default)."""

    PENDING = 8  # steps kept waiting for their events; older ones are dropped

    def __init__(self, new_event=None):
        if new_event is None:
            import torch

            def new_event():
                return torch.cuda.Event(enable_timing=True)
        self._new = new_event
        self._depth = 0
        self._begin = self._last_end = None
        self._spans: list = []  # (begin, end) of each compute span of the step
        self._gaps: list = []   # (end of one span, begin of the next)
        self._pending: deque = deque(maxlen=self.PENDING)

    def compute_begin(self) -> None:
        self._depth += 1
        if self._depth > 1:  # nested phases count once
            return
        ev = self._new()
        ev.record()
        if self._last_end is not None:
            self._gaps.append((self._last_end, ev))
        self._begin = ev

    def compute_end(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        ev = self._new()
        ev.record()
        self._spans.append((self._begin, ev))
        self._begin, self._last_end = None, ev

    def close_step(self) -> list[tuple[float, float]]:
        """Ends the step (the optimizer's time is no gap); returns (idle_s, compute_s)
        of every step, in order, whose events have all completed since the last call."""
        if self._spans or self._gaps:
            self._pending.append((self._spans, self._gaps))
        self._spans, self._gaps, self._last_end = [], [], None
        out = []
        while self._pending:
            spans, gaps = self._pending[0]
            if not all(e.query() for pair in spans + gaps for e in pair):
                break
            self._pending.popleft()
            out.append((sum(a.elapsed_time(b) for a, b in gaps) / 1e3,
                        sum(a.elapsed_time(b) for a, b in spans) / 1e3))
        return out


class GpuStepProfile(StepProfile):
    """A StepProfile whose waits and computes are the GPU's (:class:`GpuIdleClock`), not
    the CPU time inside the calls; what the CPU seams add to ``wait_s`` is dropped."""

    def __init__(self, clock: GpuIdleClock, keep: int = 8):
        super().__init__(keep)
        self.clock = clock

    def close_step(self):
        self.wait_s = self.compute_s = 0.0
        for idle_s, compute_s in self.clock.close_step():
            self.waits.append(idle_s)
            self.computes.append(compute_s)
