"""``--reft-calibrate-iters N``: what snapshots slow training by, measured in the job.

No timer of the job sees what the copies cost the iteration by sharing cores and memory
bandwidth with training (the hooks' wall time is only REFT's work on the training
thread). So, when asked, the job measures it as a user would, by A/B inside the run: for
``N`` iterations from the ``WARMUP``-th one this process trains, snapshots are skipped
in every other block of ``BLOCK`` iterations (off, on, off, on ...; every rank decides
from the iteration number alone, so the job agrees), and the median iteration time of
the blocks with snapshots is set against that of the blocks without. Each iteration's
time belongs to the block of the snapshot it carried (the snapshot of iteration i is
copied during iteration i+1); the first iteration of a block, a transition, is not
counted. What runs in both kinds of block (the pipeline instrumentation, AOR's replica,
the verdict) is not in the figure.

The cost of asking: during the calibration a failure loses up to ``BLOCK`` iterations
more (the newest snapshot is older in an off block). Off by default (0); on a noisy host
the figure is as noisy as the host: ``benchmarks/bench_overhead.py`` measures it with
rounds enough to settle it. Plain Python.
"""

from __future__ import annotations

import statistics

BLOCK = 4   # iterations per block
WARMUP = 5  # iterations of this process before the calibration begins


class Calibration:
    def __init__(self, iterations: int, first: int):
        """``iterations``: --reft-calibrate-iters (rounded up to an even number of
        blocks, at least 2); ``first``: the first iteration this process trains."""
        blocks = max(2, -(-iterations // BLOCK))
        blocks += blocks % 2
        self.start = first + WARMUP
        self.end = self.start + blocks * BLOCK - 1  # the last iteration in a block
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.done = False

    def _block(self, iteration: int) -> int | None:
        if self.start <= iteration <= self.end:
            return (iteration - self.start) // BLOCK
        return None

    def snapshot_due(self, iteration: int) -> bool:
        """False in the blocks without snapshots (even blocks: off first)."""
        b = self._block(iteration)
        return b is None or b % 2 == 1

    def observe(self, iteration: int, seconds: float) -> bool:
        """Iteration ``iteration`` took ``seconds``; True once the calibration is over
        (the iteration after its last block: its time carried the last snapshot)."""
        prev = iteration - 1
        b = self._block(prev)
        if b is not None and (prev - self.start) % BLOCK:  # not a block's first
            self.times[b % 2 == 1].append(seconds)
        if not self.done and iteration > self.end:
            self.done = True
            return True
        return False

    def result(self) -> dict | None:
        """Medians with and without snapshots and their ratio; None without both."""
        on, off = self.times[True], self.times[False]
        if not on or not off:
            return None
        m_on, m_off = statistics.median(on), statistics.median(off)
        return dict(first=self.start, last=self.end, with_ms=1000 * m_on,
                    without_ms=1000 * m_off, ratio=m_on / m_off if m_off > 0 else 1.0,
                    counted=len(on) + len(off))

    def text(self) -> str | None:
        r = self.result()
        if r is None:
            return None
        return (f"calibration (--reft-calibrate-iters): iterations {r['first']}-{r['last']}, "
                f"snapshots in every other block of {BLOCK}: median iteration "
                f"{r['with_ms']:.1f} ms with, {r['without_ms']:.1f} ms without (rank 0's, "
                f"{r['counted']} counted): snapshots slow training by "
                f"{100 * (r['ratio'] - 1):+.1f}%")
