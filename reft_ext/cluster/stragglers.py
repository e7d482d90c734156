"""Run-time straggler detection: each rank times its own forward-backward compute, its
gradient sync and its optimizer step every iteration (:class:`PhaseClock`); every
``--reft-straggler-interval`` iterations the ranks of each data-parallel group exchange
the medians of the window (one all-gather of 6 numbers per rank over that group, which
all-reduces the gradients every iteration anyway; nothing world-wide, and no collective in
the other iterations; posted without waiting and read an iteration later: :class:`Exchange`),
and
:class:`Detector` names a rank whose compute time stays above ``--reft-straggler-threshold``
times the median of the other ranks for ``--reft-straggler-window`` exchanges in a row, with what it
costs the job (in a synchronous job every other rank waits for it in the gradient sync).

Compute is the time from the start of the schedule to the gradient sync
(megatron-core's ``finalize_model_grads``, which this module's wrapper times), so a rank
waiting for a slower data-parallel peer shows the wait as sync time, not compute. Inside
a tensor- or pipeline-parallel group the peers of a slow rank wait for it inside the
schedule (its all-reduces, its p2p), so the whole model-parallel group shows the slowness
against the other data-parallel replicas: the named ranks are that group's.
"""

from __future__ import annotations

import statistics
import time

import torch

from reft_ext.testing import fault_point

SLOW_POINT = "slow-factor"  # --inject-fault R:I:CONT:slow:F (reft_ext/testing)
FIELDS = ("compute", "optimizer", "sync", "compute_sum", "sync_sum", "n")


class PhaseClock:
    """This rank's phase times of the iterations since the last exchange."""

    def __init__(self):
        self.compute: list[float] = []
        self.optimizer: list[float] = []
        self.sync: list[float] = []
        self.iteration = 0
        self._fb = self._opt = self._compute = None
        self._sync = 0.0
        self.skip = True  # the first iteration of a (re)start: warm-up, not measured

    def restart(self) -> None:
        self.__init__()

    def begin(self, iteration: int) -> None:
        self.iteration, self._fb, self._compute, self._sync = iteration, time.perf_counter(), \
            None, 0.0

    def wrap_finalize(self, finalize):
        """megatron-core's ``finalize_model_grads`` (the gradient sync), timed; the slow
        fault's sleep, proportional to the compute, goes before it."""
        def timed(*args, **kwargs):
            if self._fb is None:
                return finalize(*args, **kwargs)
            t = time.perf_counter()
            factor = fault_point(SLOW_POINT, iteration=self.iteration)
            if factor and factor > 1:
                time.sleep((factor - 1.0) * (t - self._fb))
                t = time.perf_counter()
            self._compute = t - self._fb
            try:
                return finalize(*args, **kwargs)
            finally:
                self._sync += time.perf_counter() - t
        timed.__wrapped__ = finalize
        return timed

    def optimizer_begin(self) -> None:
        self._opt = time.perf_counter()

    def end(self) -> None:
        """After the optimizer step."""
        if self._fb is None or self._opt is None:
            return
        now, skip, opt = time.perf_counter(), self.skip, self._opt
        compute = self._compute if self._compute is not None else opt - self._fb
        self._fb = self._opt = None
        self.skip = False
        if skip:
            return
        self.compute.append(compute)
        self.sync.append(self._sync)
        self.optimizer.append(now - opt)

    def window(self) -> list[float]:
        """This rank's row of the exchange (FIELDS), and the window cleared."""
        n = len(self.compute)
        med = (lambda v: statistics.median(v) if v else float("nan"))
        row = [med(self.compute), med(self.optimizer), med(self.sync), sum(self.compute),
               sum(self.sync), float(n)]
        self.compute, self.optimizer, self.sync = [], [], []
        return row


class Exchange:
    """Every member's row, in the group's rank order: one all-gather over ``group`` (the
    data-parallel group: the ranks that wait for each other in the gradient sync; on the
    device its backend needs), posted without waiting and read at :meth:`rows` an
    iteration later, when it is long complete: no rank waits for the others to arrive
    (the skew between ranks after the optimizer step was most of a blocking exchange's
    cost)."""

    def __init__(self, row: list[float], group=None):
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
        mine = torch.tensor(row, dtype=torch.float64, device=dev)
        self.out = [torch.empty_like(mine)
                    for _ in range(torch.distributed.get_world_size(group))]
        self.work = torch.distributed.all_gather(self.out, mine, group=group, async_op=True)

    def rows(self) -> list[list[float]]:
        self.work.wait()
        return [t.tolist() for t in self.out]


def waited(rows: list[list[float]], rank: int) -> float:
    """Seconds rank ``rank`` waited for the slowest rank in the window's gradient syncs:
    the slowest compute total less its own, at most the time it spent in the syncs."""
    mine = rows[rank]
    if any(r[5] != mine[5] for r in rows) or not mine[5]:
        return 0.0  # not the same iterations measured (a restart inside the window)
    return max(0.0, min(mine[4], max(r[3] for r in rows) - mine[3]))


class Detector:
    """Which ranks are persistently slow, from the exchanged rows (every rank keeps the
    same one: the rows are the job's)."""

    def __init__(self, threshold: float, window: int, interval: int):
        self.threshold, self.window, self.interval = threshold, window, interval
        self.streak: dict[int, int] = {}
        self.named: dict[int, dict] = {}   # rank -> what was said when it was named
        self.cost_s = 0.0                  # job time lost to named stragglers so far

    def observe(self, rows: list[list[float]], iteration: int) -> dict:
        """Ratios, costs and what changed: ``named`` (newly slow for ``window``
        exchanges), ``cleared`` (a named rank back under the threshold)."""
        busy = {r: row[0] + row[1] for r, row in enumerate(rows) if row[5] > 0}
        out = dict(iteration=iteration, named=[], cleared=[], ratio=1.0, slowest=None,
                   cost_s=0.0, median_s=0.0, iteration_s=0.0)
        if len(busy) < 2:
            return out
        job_it = statistics.median(rows[r][0] + rows[r][1] + rows[r][2] for r in busy)
        # each rank against the median of the others (with two ranks the median of all
        # is their mean, which no rank can exceed twofold)
        base = {r: statistics.median(v for q, v in busy.items() if q != r) for r in busy}
        ratio = {r: busy[r] / base[r] if base[r] > 0 else 1.0 for r in busy}
        slowest = max(busy, key=ratio.get)
        out.update(slowest=slowest, ratio=ratio[slowest], median_s=base[slowest],
                   iteration_s=job_it, cost_s=max(0.0, busy[slowest] - base[slowest]))
        for r, b in busy.items():
            slow = ratio[r] > self.threshold
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            info = dict(rank=r, ratio=ratio[r], busy_s=b, median_s=base[r],
                        cost_s=max(0.0, b - base[r]), iteration_s=job_it,
                        exchanges=self.streak[r], iterations=self.streak[r] * self.interval,
                        since=iteration - self.streak[r] * self.interval + 1)
            if slow and self.streak[r] >= self.window and r not in self.named:
                self.named[r] = info
                out["named"].append(info)
            elif not slow and r in self.named:
                self.named.pop(r)
                out["cleared"].append(info)
        if self.named:  # every other rank waits for the slowest named one
            self.cost_s += max(self.named[r]["cost_s"] for r in self.named) * \
                rows[slowest][5]
        return out


def named_text(info: dict, threshold: float, node: int | None) -> str:
    where = f"rank {info['rank']}" + (f" (node {node})" if node is not None else "")
    per_hour = 3600.0 * info["cost_s"] / info["iteration_s"] if info["iteration_s"] else 0.0
    return (f"straggler: {where} is {info['ratio']:.2f}x the other ranks' median forward-"
            f"backward + optimizer compute ({1000 * info['busy_s']:.1f} ms vs {1000 * info['median_s']:.1f}"
            f" ms) for {info['exchanges']} exchanges ({info['iterations']} iterations, since "
            f"iteration {info['since']}; threshold {threshold:g}x): it costs the job "
            f"{1000 * info['cost_s']:.1f} ms per iteration "
            f"({100 * info['cost_s'] / max(info['iteration_s'], 1e-9):.1f}% of the "
            f"{1000 * info['iteration_s']:.1f} ms iteration), {per_hour:.0f} s per hour")


def cleared_text(info: dict, threshold: float, node: int | None) -> str:
    where = f"rank {info['rank']}" + (f" (node {node})" if node is not None else "")
    return (f"straggler: {where} is back under {threshold:g}x the other ranks' median "
            f"({info['ratio']:.2f}x: {1000 * info['busy_s']:.1f} ms vs "
            f"{1000 * info['median_s']:.1f} ms)")
