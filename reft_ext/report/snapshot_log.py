"""REFT's snapshot lines: by default one ``[REFT] snapshots`` line per ``--log-interval``
with that interval's figures, beside Megatron's own log line (a line for every snapshot,
every iteration, buried it); ``--reft-log-every-snapshot`` prints the ``[REFT] snapshot
iteration i`` line of each snapshot instead, for debugging.

Programs read ``$REFT_EVENTS_FILE``, which gets every snapshot either way (event
``snapshot``) and each interval line (event ``snapshot_interval``).

Windows are the log's: ``(k-1)*L < iteration <= k*L`` for ``L = --log-interval``. Each rank
knows which snapshot is the last of its window (:meth:`SnapshotLog.closes_window`: a
multiple of ``--reft-snapshot-every``), so the job-wide maxima are gathered with the
snapshot's own collective then, and no other; a window the run ends in (or leaves, after a
rollback) is printed with rank 0's figures.
"""

from __future__ import annotations

import statistics

from reft_ext.report.events import emit
from reft_ext.report.summary import Window


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


class SnapshotLog:
    """One rank's figures of the snapshots of the current log window. Every rank keeps
    its maxima (gathered job-wide when the window closes); rank 0 also prints."""

    def __init__(self, interval: int, every: int, every_snapshot: bool, rank0: bool):
        self.length, self.every = max(1, interval), max(1, every)  # iterations
        self.every_snapshot, self.rank0 = every_snapshot, rank0
        self.reset()

    def reset(self) -> None:
        self.iterations: list[int] = []
        # medians over the window (bounded: a --log-interval of millions keeps 1000)
        self.blocked_s, self.copy_s, self.committed_ms = Window(), Window(), Window()
        self.tiers: dict | None = None  # schedule tier -> bytes summed (rank 0's)
        self.max_blocked_s = self.max_copy_s = 0.0
        # rank 0's REFT work per iteration: its hooks' wall time less their wait for the
        # slowest rank in the job-wide commit, what goodput books as snapshot (fed by the
        # session after each iteration, so the window's last one counts in the next)
        self.hooks_s = Window()

    def window(self, iteration: int) -> int:
        return -(-iteration // self.length)  # k of (k-1)*L < iteration <= k*L

    def closes_window(self, iteration: int) -> bool:
        """The snapshot of ``iteration`` is the last one of its window."""
        end = self.window(iteration) * self.length
        return iteration == end // self.every * self.every

    def stale(self, iteration: int) -> bool:
        """The window gathered so far is not ``iteration``'s (the run left it without its
        last snapshot: a rollback): it is printed before ``iteration`` is added."""
        return bool(self.iterations) and \
            self.window(iteration) != self.window(self.iterations[-1])

    def add(self, iteration: int, blocked_s: float, copy_s: float, committed_ms: float,
            tiers: dict | None) -> None:
        self.iterations.append(iteration)
        self.blocked_s.append(blocked_s)
        self.copy_s.append(copy_s)
        self.committed_ms.append(committed_ms)
        self.max_blocked_s = max(self.max_blocked_s, blocked_s)
        self.max_copy_s = max(self.max_copy_s, copy_s)
        if tiers is not None:
            self.tiers = {k: (self.tiers or {}).get(k, 0) + n for k, n in tiers.items()}

    # ---- the lines (rank 0) ----------------------------------------------------------
    def snapshot(self, iteration: int, what: dict, schedule: str | None, tiers: dict | None,
                 blocked_s: float, copy_s: float, committed_ms: float, slowest: bool) -> None:
        """One snapshot: its event always, its line with --reft-log-every-snapshot."""
        text = None
        if self.every_snapshot:
            text = (f"snapshot iteration {iteration}: {_what(what)}"
                    f"{_tiers(schedule, tiers)}; training blocked {_ms(blocked_s)}, copy "
                    f"{_ms(copy_s)} ({'slowest rank' if slowest else 'rank 0'}), committed "
                    f"{committed_ms:.1f} ms after the step")
        emit("snapshot", text, iteration=iteration, **what,
             schedule=schedule, tiers=tiers, blocked_ms=1000 * blocked_s,
             copy_ms=1000 * copy_s, slowest=slowest, committed_ms=committed_ms)

    def interval(self, what: dict, schedule: str | None,
                 maxima: tuple[float, float] | None) -> None:
        """The window's line and event (rank 0; not with --reft-log-every-snapshot), then
        a new window. ``maxima``: the job-wide (blocked, copy) maxima in seconds, or None
        where they were not gathered (rank 0's own)."""
        if self.iterations and self.rank0 and not self.every_snapshot:
            first, last, n = self.iterations[0], self.iterations[-1], len(self.iterations)
            its = f"iteration {first}" if first == last else f"iterations {first}-{last}"
            blocked, copy = statistics.median(self.blocked_s), statistics.median(self.copy_s)
            committed = statistics.median(self.committed_ms)
            mx_blocked, mx_copy = maxima or (self.max_blocked_s, self.max_copy_s)
            whose = "slowest rank" if maxima else "rank 0"
            copies = f", rank 0's {n} copies" if n > 1 else ", rank 0's copy"
            hooks = statistics.median(self.hooks_s) if len(self.hooks_s) else None
            said = "" if hooks is None else (
                f"REFT's work {_ms(hooks)} per iteration (rank 0's median: its hooks less "
                f"their wait for the slowest rank in the commit, what goodput books as "
                f"snapshot), of it ")
            emit("snapshot_interval",
                 f"snapshots of {its}: {n} x {_what(what)}"
                 f"{_tiers(schedule, self.tiers, copies)}; {said}training blocked "
                 f"{_ms(blocked)} median, {_ms(mx_blocked)} max; copy {_ms(copy)} median, "
                 f"{_ms(mx_copy)} max (median: rank 0, max: {whose}); committed "
                 f"{committed:.1f} ms after the step (median)",
                 hooks_ms=None if hooks is None else 1000 * hooks,
                 first=first, last=last, snapshots=n, **what, schedule=schedule,
                 tiers=self.tiers, blocked_ms={"median": 1000 * blocked,
                                               "max": 1000 * mx_blocked},
                 copy_ms={"median": 1000 * copy, "max": 1000 * mx_copy},
                 committed_ms=committed, slowest=maxima is not None)
        self.reset()


def _what(what: dict) -> str:
    """``B bytes on R ranks (per rank: own, arc|aec|none, owned[, aor])``: the job's
    snapshot (``what``: the event's fields; the redundancy region by its scheme's name)."""
    per_rank = ", ".join(f"{what['protection'] if k == 'redundancy' else k} {n}"
                         for k, n in what["per_rank"].items() if n or k != "aor")
    return f"{what['bytes']} bytes on {what['ranks']} ranks (per rank: {per_rank})"


def _tiers(schedule: str | None, tiers: dict | None, copies: str = "") -> str:
    """Where the schedule put rank 0's copy (none for a schedule without tiers)."""
    if schedule is None or tiers is None:
        return ""
    return (f", {schedule}{copies}: {tiers['bubble']} B in bubbles, {tiers['compute']} B "
            f"beside compute, {tiers['drain']} B at the step")
