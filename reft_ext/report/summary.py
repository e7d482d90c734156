"""The end-of-run REFT summary: what snapshots cost and what recoveries happened.

The counters live in the training state's small JSON part (``TrainingState.extra``
under :data:`KEY`), so they are captured in every snapshot and persistent checkpoint and
come back with the state after a restart: the summary of a job that crashed twice counts
the snapshots and recoveries of all its attempts (those of the lineage that survived:
work that a recovery rolled back is not counted twice).

Timings (blocking per snapshot, iteration time) are this process's own: medians over the
last :data:`WINDOW` values of each (a :class:`Window`, so that a run of any length keeps
a fixed memory); the line says so once a run has more.
"""

from __future__ import annotations

import statistics
from collections import deque

KEY = "reft"
WINDOW = 1000  # per-iteration timings kept for the summary's medians


class Window:
    """The last ``size`` values of a series that grows every iteration, and how many there
    were in all: memory stays fixed over a run of any length."""

    def __init__(self, size: int = WINDOW):
        self.values: deque[float] = deque(maxlen=size)
        self.count = 0  # values ever appended

    def append(self, value: float) -> None:
        self.values.append(value)
        self.count += 1

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)


def counters(extra: dict) -> dict:
    """REFT's counters inside ``extra`` (created on first use)."""
    c = extra.setdefault(KEY, {})
    c.setdefault("snapshots", 0)
    c.setdefault("recoveries", {})
    return c


def count_snapshot(extra: dict) -> None:
    counters(extra)["snapshots"] += 1


def count_rollback(extra: dict) -> None:
    c = counters(extra)
    c["rollbacks"] = c.get("rollbacks", 0) + 1


def count_recovery(extra: dict, tier: str) -> None:
    rec = counters(extra)["recoveries"]
    rec[tier] = rec.get(tier, 0) + 1


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _of(values, what: str) -> str:
    """What a median covers, where a :class:`Window` dropped older values."""
    if isinstance(values, Window) and values.count > len(values):
        return f" of the last {len(values)} {what}"
    return ""


BENCHMARK = "python benchmarks/bench_overhead.py"  # what measures the slowdown (A/B)


def format_summary(*, extra: dict, every: int, regions: dict, blocked_s, iteration_s,
                   host_bytes_per_node: int, nodes: int, protection: str,
                   hooks: tuple | None = None, calibration: dict | None = None) -> str:
    """One line (without the ``[REFT]`` prefix). ``regions``: name -> bytes per rank;
    ``blocked_s`` (per snapshot), ``iteration_s``: lists or :class:`Window` s;
    ``hooks``: (seconds, iterations, ranks[, waited seconds]) of REFT's hooks summed
    over the ranks: their wall time on the training thread, less the waiting for the
    slowest rank in the job-wide commit (which the step's own all-reduce does as long
    without REFT), is what goodput books as "snapshot". The copy wait is only a part
    of it. What snapshots slow training by against a run without them (cores and
    memory bandwidth shared with the copies) no line of the job can measure: the line
    names the benchmark that does."""
    c = counters(extra)
    total = sum(regions.values())
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in regions.items() if v)
    line = (f"summary: {c['snapshots']} snapshots (every {every} iteration"
            f"{'s' if every != 1 else ''}, --reft-protect {protection}), "
            f"{_mib(total)} MiB per rank ({parts} MiB)")
    it = statistics.median(iteration_s) if iteration_s else None
    if hooks is not None and hooks[1] > 0:
        seconds, iterations, ranks = hooks[:3]
        waited = hooks[3] if len(hooks) > 3 else 0.0
        own = (seconds - waited) / iterations  # what goodput books as "snapshot"
        line += f"; REFT's hooks {1000 * seconds / iterations:.2f} ms per iteration (mean " \
                f"of {ranks} ranks)"
        if waited > 0:
            line += (f", of it {1000 * waited / iterations:.2f} ms waiting for the slowest "
                     f"rank in the job-wide commit (the step's own all-reduce waits as long "
                     f"without REFT: goodput books it productive) and")
        line += (f" {1000 * own:.2f} ms REFT's work (goodput's \"snapshot\": "
                 f"{(seconds - waited) / max(1, ranks):.2f} s per rank in this process)")
        if it:
            line += (f", {100 * own / it:.2f}% of the median iteration ({1000 * it:.1f} ms"
                     f"{_of(iteration_s, 'iterations')})")
    if blocked_s:
        blocked = statistics.median(blocked_s)
        line += (f"; of it training blocked on the copy {1000 * blocked:.2f} ms per "
                 f"snapshot (median{_of(blocked_s, 'snapshots')})")
    if calibration is not None:  # --reft-calibrate-iters (report/calibration.py)
        line += (f"; slowdown against no snapshots: {100 * (calibration['ratio'] - 1):+.1f}% "
                 f"(--reft-calibrate-iters, iterations {calibration['first']}-"
                 f"{calibration['last']}: {calibration['with_ms']:.1f} vs "
                 f"{calibration['without_ms']:.1f} ms median; as noisy as the host, "
                 f"{BENCHMARK} settles it with rounds)")
    elif blocked_s or hooks is not None:
        line += (f"; slowdown against no snapshots (copies sharing cores and memory "
                 f"bandwidth with training): not measured by the job (--reft-calibrate-"
                 f"iters N measures it), {BENCHMARK} measures it")
    rec = c["recoveries"]
    if rec:
        line += "; recoveries: " + ", ".join(
            f"{n} from {tier}" for tier, n in sorted(rec.items(), key=lambda kv: -kv[1]))
    else:
        line += "; recoveries: none"
    if c.get("rollbacks"):
        line += f"; loss-spike rollbacks: {c['rollbacks']}"
    line += f"; host memory {_mib(host_bytes_per_node)} MiB per node ({nodes} nodes)"
    return line
