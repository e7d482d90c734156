"""Loss-spike rollback from host memory: detect a spike or a NaN, roll every rank back to
a snapshot from before it, skip the offending batches, go on. No disk, no restart.

The field's practice (PaLM, OPT, BLOOM, Falcon) does this by hand: stop, reload a
checkpoint from hours earlier, skip a few hundred batches around the spike, resume. With
a snapshot in memory every iteration it takes one REFT-load (milliseconds) in process.

* Detection (:class:`SpikeDetector`, pure): after each step every rank feeds it the same
  job-wide values (loss from the last pipeline stage, the grad norm, a non-finite flag;
  the trainer all-reduces them first, so a NaN on one rank is seen by all). ``nan`` mode
  rolls back on a non-finite loss or grad norm; ``spike`` mode also on a loss or grad norm
  above ``median + k * MAD`` of the last W finite values (robust to the slow drift of a
  falling loss; a MAD floor of 5% of the median keeps a flat or slowly drifting history,
  such as the grad norm early in training, from firing on noise).
* Target: the oldest of the ``--reft-keep`` snapshots in the ring, i.e. up to
  (K-1) x ``--reft-snapshot-every`` iterations before the spike: the update that caused a
  loss spike happened one step before the spike shows. With local commits (K >= 3) the
  slot they add for their one-iteration skew is not counted (K = 3 reaches as far back
  as 2 did with job-wide commits).
* Skip (``ReftSession.rollback``): back at iteration R after a spike at S, the data
  position moves past the batches of R+1..S, the spiking one always included (trained
  on again, a bad batch spikes again), or ``--reft-skip-batches`` batches from R's
  position if that is more.
* A bound (``--reft-rollback-limit`` rollbacks within ``--reft-spike-window`` iterations)
  stops a job that would otherwise loop, with an error naming the flag.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from reft_ext.config import ReftConfigError
from reft_ext.flags import ReftFlags

MODES = ("off", "nan", "spike")


class RollbackError(RuntimeError):
    """A rollback that cannot be done: the message names the flag and what to do."""


class RollbackLimitError(RollbackError):
    """More rollbacks than --reft-rollback-limit within --reft-spike-window iterations."""


@dataclass
class RollbackConfig(ReftFlags):
    """Loss-spike rollback settings, one ``--reft-<field>`` flag each."""

    FLAG_TITLE = "REFT loss-spike rollback from host memory"  # add_arguments, from_args

    rollback_on: str = field(default="nan", metadata=dict(
        help="roll back in memory (needs --reft-snapshot-every): off | nan (a non-finite "
             "loss or grad norm) | spike (also a loss or grad norm above median + "
             "--reft-spike-threshold x MAD of the last --reft-spike-window iterations)"))
    spike_threshold: float = field(default=6.0, metadata=dict(
        help="spike rule: how many median absolute deviations above the median"))
    spike_window: int = field(default=20, metadata=dict(
        help="spike rule: iterations of history (judged once 8 or W are known), and the "
             "window of --reft-rollback-limit"))
    rollback_limit: int = field(default=3, metadata=dict(
        help="at most this many rollbacks within --reft-spike-window iterations; one more "
             "stops the job with an error instead of looping"))
    skip_batches: int = field(default=1, metadata=dict(
        help="after a rollback to iteration R of a spike at S, skip the global batches of "
             "iterations R+1..S (the batches that led to the spike, the spiking one "
             "always included), or this many from the restored data position if that is "
             "more; the sample indices and iterations are logged"))

    def __post_init__(self):
        if self.rollback_on not in MODES:
            raise ReftConfigError(f"--reft-rollback-on: unknown value {self.rollback_on!r}; "
                                  f"choose from {', '.join(MODES)}")
        if not self.spike_threshold > 0:
            raise ReftConfigError(f"--reft-spike-threshold: must be > 0, got "
                                  f"{self.spike_threshold:g}")
        if self.spike_window < 2:
            raise ReftConfigError(f"--reft-spike-window: must be >= 2, got {self.spike_window}")
        if self.rollback_limit < 1:
            raise ReftConfigError(f"--reft-rollback-limit: must be >= 1, got "
                                  f"{self.rollback_limit}")
        if self.skip_batches < 1:  # 0 would read as "skip nothing", which no rollback does
            raise ReftConfigError(f"--reft-skip-batches: must be >= 1 (a rollback always "
                                  f"skips through the spiking batch), got {self.skip_batches}")

    @property
    def enabled(self) -> bool:
        return self.rollback_on != "off"



@dataclass(frozen=True)
class Skip:
    """The global batches a rollback to iteration ``target`` skips after a spike at
    ``spike``: samples ``first``..``last``, ``after_spike`` of the batches past the
    spiking one."""

    target: int
    spike: int
    first: int
    last: int
    batches: int
    after_spike: int

    def text(self) -> str:
        which = (f"iteration {self.spike}'s" if self.target + 1 == self.spike else
                 f"iterations {self.target + 1}-{self.spike}'s, through the spiking one")
        more = f", and {self.after_spike} after it" if self.after_spike else ""
        return (f"skipped {self.batches} global batch(es) ({which}{more}): samples "
                f"{self.first}-{self.last}")


def batches_to_skip(target: int, spike: int, restored_samples: int, spike_samples: int,
                    global_batch_size: int, skip_batches: int) -> Skip:
    """What a rollback skips. ``restored_samples``: the data position of the snapshot of
    ``target``; ``spike_samples``: the position after ``spike`` (the end of the batch that
    spiked). The batches of target+1..spike are skipped whatever the ring's depth, the
    spiking one last (trained on again, it spikes again): the data position is one
    counter, so the skip is one range from the restored position, stretched to
    ``skip_batches`` batches if that is more."""
    gbs = global_batch_size
    through = max(spike_samples - restored_samples, 0)
    skip = max(through, skip_batches * gbs)
    return Skip(target, spike, restored_samples, restored_samples + skip - 1, skip // gbs,
                (skip - through) // gbs)


MIN_HISTORY = 8    # finite values needed before the spike rule judges
MAD_FLOOR = 0.05   # the MAD never counts as less than this fraction of the median


def _outlier(value: float, history: list[float], k: float) -> str | None:
    if len(history) < 2:
        return None
    med = statistics.median(history)
    mad = statistics.median(abs(x - med) for x in history)
    # a flat or slowly drifting history must not turn noise into spikes: a rise below
    # k x 5% of the median is never one (k = 6: +30%)
    floor = MAD_FLOOR * abs(med) + 1e-12
    limit = med + k * max(mad, floor)
    if value > limit:
        return f"{value:.6g} > median {med:.6g} + {k:g} x MAD {mad:.3g} = {limit:.6g}"
    return None


class SpikeDetector:
    """Same inputs on every rank -> same verdict on every rank (no extra agreement)."""

    def __init__(self, cfg: RollbackConfig):
        self.cfg = cfg
        self.history: list[tuple[int, float, float]] = []  # (iteration, loss, grad norm)
        self.rollbacks: list[int] = []  # iterations at which a rollback was decided

    def observe(self, iteration: int, loss: float | None, grad_norm: float | None) -> str | None:
        """The reason to roll back after ``iteration``, or None (and the values are kept)."""
        if not self.cfg.enabled:
            return None
        for name, v in (("loss", loss), ("grad norm", grad_norm)):
            if v is not None and not math.isfinite(v):
                return f"non-finite {name} ({v})"
        if self.cfg.rollback_on == "spike" and len(self.history) >= MIN_HISTORY:
            recent = self.history[-self.cfg.spike_window:]
            for name, v, col in (("loss", loss, 1), ("grad norm", grad_norm, 2)):
                if v is None:
                    continue
                why = _outlier(v, [h[col] for h in recent if h[col] is not None],
                               self.cfg.spike_threshold)
                if why:
                    return f"{name} spike: {why} over the last {len(recent)} iterations"
        self.history.append((iteration, loss, grad_norm))
        del self.history[:-self.cfg.spike_window]
        return None

    def rolled_back(self, spike_iteration: int, target: int) -> int:
        """Record a rollback; forget the history after ``target`` (it is redone). Returns
        how many rollbacks fall in the window; raises past the limit."""
        w = self.cfg.spike_window
        self.rollbacks = [i for i in self.rollbacks if i > spike_iteration - w]
        self.rollbacks.append(spike_iteration)
        self.history = [h for h in self.history if h[0] <= target]
        if len(self.rollbacks) > self.cfg.rollback_limit:
            raise RollbackLimitError(
                f"--reft-rollback-limit: {len(self.rollbacks)} rollbacks within "
                f"{w} iterations (--reft-spike-window), the limit is "
                f"{self.cfg.rollback_limit}: stopping rather than looping. Check the data "
                f"around the logged sample indices, lower the learning rate, or raise "
                f"--reft-skip-batches / --reft-rollback-limit")
        return len(self.rollbacks)
