"""Pipeline bubbles and Algorithm 1's tier split: the arithmetic shared by the HAS
scheduler (which feeds it measured times) and the planner (which feeds it estimates).

Notation: P pipeline stages, m micro-batches per iteration, v model chunks per stage
(interleaved schedule), t_fb = forward + backward time of one micro-batch on the whole
stage (all its chunks).

1F1B: every stage computes for m * t_fb per iteration and the iteration lasts
(m + P - 1) * t_fb, so each stage idles (P - 1) * t_fb: stage p waits p forward times
during warm-up and the rest during cool-down (Narayanan et al., SC'21, eq. 1).
Interleaved with v chunks per stage: the bubble shrinks v times, to (P - 1) * t_fb / v.
"""

from __future__ import annotations

from dataclasses import dataclass

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
