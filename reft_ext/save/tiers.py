"""Algorithm 1 with measured inputs: which chunks of a snapshot wait for a pipeline
bubble (tier 1) and which may be copied beside compute (tier 2).

Inputs, all measured on this rank: BW_io (:class:`Bandwidth`, from the last snapshots'
copy + hash time), T_bubble (:func:`bubble_estimate`, from the step profile of
:class:`reft_ext.report.timeline.PipelineEvents`) and whether a tier-2 copy can really
run beside compute on this node (:func:`concurrent_tier2`). The arithmetic itself
(``tier_split``) is shared with the planner: reft_ext/save/bubbles.py.
"""

from __future__ import annotations

import torch

from reft_ext import _native
from reft_ext.save.bubbles import bubble_time, snapshot_time, tier_split
from reft_ext.save.has import TIER1, TIER2, Batch
from reft_ext.store.checksum import CHUNK


class Bandwidth:
    """BW_io of Algorithm 1 in bytes/s: the median of the last three snapshots' copy +
    hash rates (``value`` None before the first: a snapshot then waits for the bubbles
    and the step, never competing with compute)."""

    def __init__(self):
        self.value: float | None = None
        self._samples: list[float] = []

    def record(self, nbytes: int, busy_s: float) -> None:
        """One snapshot's bytes and the seconds its units ran (too small a snapshot, one
        chunk or less, says nothing about the rate)."""
        if busy_s > 0 and nbytes >= CHUNK:
            self._samples = [*self._samples[-2:], nbytes / busy_s]
            self.value = sorted(self._samples)[len(self._samples) // 2]


def concurrent_tier2(setting: str, tensors: list[torch.Tensor], local_ranks: int) -> bool:
    """Can a copy run beside compute without taking the compute's place? A device-to-host
    copy can (copy engines); on a CPU only when the node has cores the ranks' compute
    threads leave idle. Otherwise a chunk copied "beside" compute just delays it, and on
    an early pipeline stage delays every later stage too: better at the drain.
    ``setting``: --reft-has-tier2 (auto, concurrent or deferred)."""
    if setting != "auto":
        return setting == "concurrent"
    if any(t.device.type != "cpu" for t in tensors):
        return True
    return _native.num_cpus() > local_ranks * torch.get_num_threads()


def bubble_estimate(profile, pipeline: tuple[int, int, int]) -> float:
    """T_bubble: the larger of the 1F1B formula (P-1) * t_fb, t_fb measured from this
    stage's compute phases, and the profile of the p2p waits of recent steps: the waits
    see the warm-up/steady-state bubbles (and any imbalance), the formula also counts the
    cool-down idle of the later stages, which falls after their last backward, where the
    drain copies. ``pipeline``: (pp, vpp, micro-batches)."""
    compute, (pp, vpp, m) = profile.compute(), pipeline
    formula = bubble_time(pp, compute / m, vpp) if compute else 0.0
    return max(formula, profile.bubble() or 0.0)


# BW_io before any snapshot measured it: a low guess (one core copying and hashing), so
# the first snapshot gives the bubbles no more than they can hold, the rest is tier 2
PRIOR_BANDWIDTH = 1e9


def plan_tiers(batch: Batch, bandwidth: float | None, t_bubble: float,
               concurrent: bool, everything_tier2: bool = False,
               device: bool = False) -> None:
    """Set ``batch.split`` and each unit's tier: the first ``split.bubble_bytes`` (in unit
    order) are tier 1; without ``concurrent`` tier 2 waits, like tier 1, for a bubble or
    the drain. ``everything_tier2``: the host-thread baseline (copies at once, unaware of
    the bubbles; pass ``t_bubble`` 0). ``device``: the units are device state, copied by
    the GPU's copy engine whatever the CPU does (the CPU never sits in an NCCL p2p call
    for a bubble's length, so a tier-1 unit would wait for the drain): with
    ``concurrent`` every unit is tier 2, copied beside compute at once."""
    nbytes = sum(u.nbytes for u in batch.units)
    t_snap = snapshot_time(nbytes, bandwidth or PRIOR_BANDWIDTH)
    split = tier_split(nbytes, t_snap, t_bubble)
    if device and concurrent:
        everything_tier2 = True
    batch.split, seen = split, 0
    for u in batch.units:
        bubble = seen < split.bubble_bytes or not concurrent
        u.tier = TIER2 if everything_tier2 or not bubble else TIER1
        seen += u.nbytes
