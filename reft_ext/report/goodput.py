"""Goodput: every second of a rank's wall time in one category, added up across the
attempts of a job.

A :class:`Ledger` is a clock with one current category: ``switch(cat)`` books the time
since the last switch to the category that was current, so the categories always sum to
the time since the ledger started (no second is booked twice or lost). Some facts are
known only later (an iteration's work was lost to a failure, undone by a rollback, or
spent waiting for a slower rank): ``move`` re-books seconds from one category to another.

The ledger is recorded as a ``goodput`` event (reft_ext/report/events.py) every
``--log-interval`` and at the end; each record holds the job's totals for that rank so
far. A restarted process finds its rank's newest record of the same run in the events
file (:func:`previous`) and goes on from it (:meth:`Ledger.carry`): the time between that
record and its own start is the failure's detection, the iterations the record counted
beyond the restored one are lost. So the newest record per rank is the job's figure, and
``tools/reft_status.py`` and the end-of-run line read just that. Plain Python (no torch):
the status tool imports it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager

# in the order the end-of-run line prints them (docs/operations.md "Goodput")
PRODUCTIVE = "productive"
CATEGORIES = (
    PRODUCTIVE,       # iterations kept (forward, backward, optimizer, logging)
    "snapshot",       # REFT's blocking per iteration (its hooks: copy wait, commit)
    "checkpoint",     # persistent checkpoint saves (--save)
    "validation",     # --eval-interval
    "startup",        # process start to the first iteration (the first attempt)
    "detection",      # last completed iteration -> the failure seen (or the new process)
    "abort",          # leaving the failed generation (in-process restart)
    "rejoin",         # the new generation / process up to training, less the restore
    "restore",        # loading the state (REFT-load, --load)
    "first_iteration",  # the first iteration after a failure, beyond a median one
    "lost",           # iterations done after the restored state: redone
    "rollback",       # iterations undone by a loss-spike rollback, and the rollback
    "straggler_wait",  # waiting in the gradient sync for a slower rank
)
FAILURE = ("detection", "abort", "rejoin", "restore", "first_iteration", "lost")
EVENT = "goodput"
RECENT = 4096  # iterations whose productive seconds are kept (to re-book them as lost)


class Ledger:
    def __init__(self, start: float, category: str = "startup"):
        self.start = start          # when this job's first attempt of this rank began
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.current, self.since = category, start
        self.recent: dict[int, float] = {}  # iteration -> its productive seconds
        self.failures = self.rollbacks = self.iterations = self.attempts = 0
        self.swaps = 0  # planned restarts that put a spare in a straggler's place
        self.first_pending = False   # the next iteration is the first after a failure
        self._begin: dict | None = None  # the totals when the iteration in flight began
        self._first: tuple[int, str] | None = None  # a first iteration, its excess unbooked
        self.marks: dict[str, float] = {}  # this process's load start/end (start-up)

    # ---- the clock --------------------------------------------------------------
    def switch(self, category: str, now: float | None = None) -> str:
        """Book the time since the last switch to the current category; ``category`` is
        current from now on. Returns the one it replaced."""
        now = time.time() if now is None else now
        self.seconds[self.current] += max(0.0, now - self.since)
        prev, self.current, self.since = self.current, category, max(self.since, now)
        return prev

    @contextmanager
    def phase(self, category: str):
        prev = self.switch(category)
        try:
            yield
        finally:
            self.switch(prev)

    def move(self, src: str, dst: str, seconds: float) -> float:
        """Re-book up to ``seconds`` from ``src`` to ``dst`` (never below zero)."""
        s = max(0.0, min(seconds, self.seconds[src]))
        self.seconds[src] -= s
        self.seconds[dst] += s
        return s

    def totals(self, now: float | None = None) -> dict[str, float]:
        """The categories with the current one's running time included."""
        now = time.time() if now is None else now
        out = dict(self.seconds)
        out[self.current] += max(0.0, now - self.since)
        return out

    # ---- iterations -------------------------------------------------------------
    def begin_iteration(self) -> None:
        self.switch(PRODUCTIVE)
        self._begin = dict(self.seconds)

    def end_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` is complete and kept. The first one after a (re)start
        books what it took beyond a median iteration as the failure's (or the first
        attempt's start-up), once three more give the median."""
        self.switch(PRODUCTIVE)
        took = self.seconds[PRODUCTIVE] - (self._begin or self.seconds)[PRODUCTIVE]
        self._begin = None
        if self.first_pending or not self.iterations:
            self._first = (iteration, "first_iteration" if self.first_pending else "startup")
            self.first_pending = False
        self.recent[iteration] = took
        if len(self.recent) > RECENT:
            del self.recent[min(self.recent)]
        self.iterations += 1
        first = self._first
        if first is not None and first[0] not in self.recent:
            self._first = None  # undone meanwhile (a failure, a rollback)
        elif first is not None and len(self.recent) >= 4:
            others = [t for i, t in self.recent.items() if i != first[0]]
            excess = self.recent[first[0]] - statistics.median(others[-64:])
            if excess > 0:
                self.recent[first[0]] -= self.move(PRODUCTIVE, first[1], excess)
            self._first = None

    def median_iteration(self) -> float | None:
        if len(self.recent) >= 3:
            return statistics.median(self.recent.values())
        return self.seconds[PRODUCTIVE] / self.iterations if self.iterations else None

    def _undo(self, to: int, dst: str) -> float:
        """Re-book the productive seconds of the iterations after ``to`` to ``dst``."""
        gone = [i for i in self.recent if i > to]
        moved = sum(self.move(PRODUCTIVE, dst, self.recent.pop(i)) for i in gone)
        self.iterations = max(0, self.iterations - len(gone))
        return moved

    def _partial(self, dst: str) -> None:
        """The iteration in flight (begun, never completed): its time so far to ``dst``."""
        if self._begin is None:
            return
        for cat, before in self._begin.items():
            if cat != dst:
                self.move(cat, dst, self.seconds[cat] - before)
        self._begin = None

    def rolled_back(self, to: int) -> None:
        """A loss-spike rollback took the state back to ``to``, inside an iteration."""
        self.switch("rollback")
        self._partial("rollback")
        self._undo(to, "rollback")
        self.rollbacks += 1
        self.switch(PRODUCTIVE)

    def failed(self, planned: bool = False) -> None:
        """A failure reached this rank (in-process restart): from the last completed
        iteration to now is its detection; leaving the generation (abort) begins.
        ``planned``: a straggler swap, not a failure (its downtime is booked the same
        way, counted as a swap)."""
        self.switch("detection")
        self._partial("detection")
        if planned:
            self.swaps += 1
        else:
            self.failures += 1
        self.switch("abort")

    def restored(self, iteration: int) -> None:
        """The state is ``iteration``'s again (after a failure): later work is lost."""
        self._undo(iteration, "lost")
        self.first_pending = True

    def loading(self, start: bool) -> None:
        """REFT-load / --load begins (``start``) or ends: an in-process restart's restore,
        or a start-up's marks (split at the first iteration, :meth:`carry`)."""
        if self.current in ("abort", "rejoin", "restore"):
            self.switch("restore" if start else "rejoin")
        else:
            self.marks["load_start" if start else "load_end"] = time.time()

    # ---- across attempts --------------------------------------------------------
    def record(self, **fields) -> dict:
        """The event's fields: the job's totals for this rank so far."""
        now = time.time()
        # "time" too: the event's own stamp, a moment later, would open a gap to the next
        # attempt's books
        return dict(seconds=self.totals(now), start=self.start, wall=now - self.start,
                    time=now,
                    failures=self.failures, rollbacks=self.rollbacks, swaps=self.swaps,
                    iterations=self.iterations, attempts=self.attempts + 1,
                    iteration_s=self.median_iteration(), **fields)

    def carry(self, prev: dict, restored: int) -> None:
        """Go on from ``prev`` (this rank's newest record of an earlier attempt): its
        totals are added; the time from its record to this process's start is the
        failure's detection (the process was dead or being replaced); its iterations after
        ``restored`` are lost; this process's start-up is the failure's rejoin and restore.
        A warm spare that started before ``prev`` was written counts from then."""
        self.switch(self.current)  # this process's time so far, booked
        t0, rec = self.start, prev.get("time", self.start)
        split = _startup_split(self.marks, t0, self.seconds["startup"])
        late = max(0.0, rec - t0)   # a warm spare started before the record
        self.seconds["startup"] = 0.0
        for cat, s in split.items():
            cut = min(late, s)
            late -= cut
            self.seconds[cat] += s - cut
        for cat, s in (prev.get("seconds") or {}).items():
            if cat in self.seconds:
                self.seconds[cat] += float(s)
        self.seconds["detection"] += max(0.0, t0 - rec)
        self.start = float(prev.get("start", t0))
        # the process it goes on from left for a straggler swap, or failed
        swapped = bool(prev.get("swapped_out"))
        self.failures += int(prev.get("failures", 0)) + (0 if swapped else 1)
        self.swaps += int(prev.get("swaps", 0)) + (1 if swapped else 0)
        self.rollbacks += int(prev.get("rollbacks", 0))
        self.attempts = int(prev.get("attempts", 1))
        done, per = int(prev.get("iteration") or 0), prev.get("iteration_s") or 0.0
        if done > restored and per:  # done again: lost (a median iteration each)
            self.move(PRODUCTIVE, "lost", (done - restored) * per)
        elif restored > done and per:  # kept after the record: in the gap, not detection
            self.move("detection", PRODUCTIVE, min((restored - done) * per,
                                                    max(0.0, t0 - rec)))
        self.iterations = restored  # the state's iteration: the iterations kept
        if per:
            self.recent = {restored - i: per for i in range(min(3, restored))}
        self.first_pending = True


def _startup_split(marks: dict, t0: float, total: float) -> dict[str, float]:
    """A restarted process's start-up: rejoin up to the load, restore, rejoin after."""
    a, b = marks.get("load_start"), marks.get("load_end")
    if a is None or b is None or not t0 <= a <= b:
        return {"rejoin": total}
    restore = min(total, b - a)
    return {"restore": restore, "rejoin": total - restore}


def default_path(job_id: str) -> str:
    """Where a job's goodput records go when ``$REFT_EVENTS_FILE`` is unset: a private
    directory of this user's (``$TMPDIR/reft-<uid>/goodput``, 0700) holding one file per
    job id, which a restarted process of the job (same id) finds on the same node."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"reft-{os.geteuid()}", "goodput",
                        f"{job_id}.jsonl")


def prepare_default(path: str) -> str | None:
    """Make the private directories of :func:`default_path`; None (and one line said)
    where they cannot be this user's own (another user made one first)."""
    from reft_ext.report.events import refuse_once
    from reft_ext.safe_dir import open_dir

    try:
        open_dir(os.path.dirname(os.path.dirname(path)), create=True, fix_mode=False).close()
        open_dir(os.path.dirname(path), create=True).close()
    except OSError as exc:
        refuse_once(path, exc, what="goodput")
        return None
    return path


_NUMBER = (int, float)


def valid(rec) -> bool:
    """A goodput record whose fields have the types :meth:`Ledger.carry` and
    :func:`job_totals` read (a record with ``"failures": "pwned"`` is not one)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("seconds"), dict):
        return False
    if not all(isinstance(v, _NUMBER) and not isinstance(v, bool) and v >= 0
               and v == v and v != float("inf") for v in rec["seconds"].values()):
        return False
    for k in ("start", "wall", "time", "iteration_s"):
        v = rec.get(k, 0.0)
        if v is not None and (not isinstance(v, _NUMBER) or isinstance(v, bool) or v != v):
            return False
    for k in ("failures", "rollbacks", "swaps", "attempts", "iterations", "iteration"):
        v = rec.get(k, 0)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return False
    return True


def previous(path: str | None, run: str, rank: int, pid: int) -> dict | None:
    """This rank's newest ``goodput`` record of run ``run`` written by another process.
    The file is read only if this user's own, never through a link
    (reft_ext/report/events.py ``open_own``); a malformed record is skipped, with one
    line (never fatal: the books start afresh rather than from forged figures)."""
    from reft_ext.report.events import open_own, refuse_once

    if not path:
        return None
    best, bad = None, 0
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        refuse_once(path, exc, what="goodput")
        return None
    with os.fdopen(fd, "rb") as f:
        for line in f:
            if b'"goodput"' not in line:  # most lines are other events: no parse
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line a killed process left half-written
            # a final record: that process ended the job normally (a later one is a new
            # launch, e.g. a re-run that loads its checkpoint; no failure to carry)
            if not isinstance(e, dict) or e.get("event") != EVENT or e.get("run") != run \
                    or e.get("rank") != rank or e.get("pid") == pid or e.get("final"):
                continue
            if not valid(e):
                bad += 1
                continue
            if best is None or e.get("time", 0) >= best.get("time", 0):
                best = e
    if bad:
        print(f"[REFT] goodput: {bad} malformed record(s) of rank {rank} in {path} "
              f"skipped", flush=True)
    return best


def latest(events: list[dict]) -> dict[str, dict[int, dict]]:
    """run -> rank -> the newest goodput record of that rank (the job's totals);
    malformed records are left out."""
    out: dict[str, dict[int, dict]] = {}
    for e in events:
        if e.get("event") != EVENT or not isinstance(e.get("rank"), int) or not valid(e):
            continue
        runs = out.setdefault(str(e.get("run")), {})
        old = runs.get(e["rank"])
        if old is None or e.get("time", 0) >= old.get("time", 0):
            runs[e["rank"]] = e
    return out


def job_totals(records: list[dict]) -> dict:
    """The mean over ranks of each category, the wall time and the counts."""
    n = max(1, len(records))
    sec = {c: sum(float(r["seconds"].get(c, 0.0)) for r in records) / n for c in CATEGORIES}
    return dict(seconds=sec, wall=sum(float(r["wall"]) for r in records) / n,
                failures=max((int(r.get("failures", 0)) for r in records), default=0),
                rollbacks=max((int(r.get("rollbacks", 0)) for r in records), default=0),
                swaps=max((int(r.get("swaps", 0)) for r in records), default=0),
                iterations=max((int(r.get("iterations", 0)) for r in records), default=0),
                attempts=max((int(r.get("attempts", 1)) for r in records), default=1),
                ranks=len(records))
