"""Hang detection: a heartbeat per rank in its node's shared memory, read by the node's
watcher (reft_ext/cluster/watcher.py), which SIGKILLs a rank that made no progress for
``--reft-hang-timeout`` seconds. torchrun then restarts the workers at once and REFT-load
restores the last snapshot from memory, instead of the job sitting in a collective until
``--distributed-timeout-minutes`` runs out.

    <shm>/reft-<job>/node<n>/rank<r>.heartbeat    32 bytes, 0600, mmap'd by rank r

Record: seq (u64, +1 per beat), iteration (i64, the last completed), state (u32), pid
(u32), t (f64, CLOCK_MONOTONIC of the last beat; one clock for every process of a host).
A beat is one 32-byte copy into the mapping (about a microsecond, no system call),
so ranks beat at every schedule event (each micro-batch's compute phases, each p2p wait,
the snapshot commit, the optimizer step), not only once per iteration.

States, and why a running rank has two:

* PAUSED: not judged. Start-up, REFT-load and the first iteration (warm-up, allocation,
  kernel compilation on a GPU) come before arming; checkpoint saves, validation and the
  shutdown pause it. They beat nowhere and may legitimately take long; a collective stuck
  there still ends at the distributed timeout.
* WORKING: computing a micro-batch's forward or backward, or preparing the optimizer step.
  Silent for the timeout = hung.
* WAITING: communicating (p2p waits, gradient sync, the optimizer's collectives, the
  snapshot drain and commit, the bookkeeping between iterations). When one rank hangs,
  every other rank soon waits for it in some collective and stops beating too: victims,
  not culprits. The culprit's watcher kills it at the timeout, which makes the victims'
  collectives fail; so a waiting rank gets twice the timeout: late enough not to blame
  the victims, yet a hang inside communication itself (every rank waiting) is still
  caught long before the collective timeout.

Two refinements keep the verdict on the culprit alone. A computing rank that has slept in
the kernel since its beat (no CPU time, not runnable) waits inside its compute phase for a
peer - a tensor-parallel all-reduce in a layer's forward - and gets the waiting limit too
(until its next beat: woken by the culprit's death, it runs while it dies).
A stopped process (SIGSTOP, /proc state T) is the culprit whatever its last state, and
gets the working limit: it is killed before the peers that wait for it, whose failed
collectives then end them without a verdict of their own.

A busy node is not a hung one: a rank's silence is wall time minus the time its main thread
(the one that beats) spent runnable but waiting for a CPU since the beat: the kernel's run
delay (/proc/<pid>/schedstat) plus a wait still in progress, as the watcher sees them from
the beat on. On a host with more runnable threads than cores a compute phase of 1 s can
take many seconds of wall time. A stopped, deadlocked or blocked rank waits for no CPU, so
it is still caught at the timeout however busy the host; a rank spinning without progress
is caught once it had the timeout's worth of CPU. What stays wall time: a waiting rank's
silence while a peer elsewhere is starved (covered by the waiting factor only).

Plain Python (no torch): the watcher imports it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from contextlib import contextmanager

PAUSED, WORKING, WAITING = 0, 1, 2
STATE_NAMES = {PAUSED: "paused", WORKING: "computing", WAITING: "waiting for peers"}
WAITING_FACTOR = 2  # a waiting rank's limit, in timeouts (see the module docstring)
WORK_PHASES = ("forward-compute", "backward-compute")
BLOCKED_MIN_S, BLOCKED_SHARE = 0.5, 0.25  # HangMonitor._blocked
_REC = struct.Struct("<QqIId")  # seq, iteration, state, pid, t


def path(node_dir: str, rank: int) -> str:
    return os.path.join(node_dir, f"rank{rank}.heartbeat")


class Heartbeat:
    """The rank's side. Starts PAUSED; :meth:`iteration_done` arms it after the first
    iteration this process completes (so start-up, recovery and warm-up are never judged)."""

    def __init__(self, node_dir: str, rank: int, iteration: int = 0):
        self.path = path(node_dir, rank)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, _REC.size)  # a full tmpfs: ENOSPC here, not SIGBUS
            self._mm = mmap.mmap(fd, _REC.size)
        finally:
            os.close(fd)
        self.pid, self.seq, self.iteration = os.getpid(), 0, iteration
        self.state, self.armed, self._pauses = WAITING, False, 0
        self.beat()

    def beat(self, state: int | None = None) -> None:
        if state is not None:
            self.state = state
        if self._mm is None:
            return
        self.seq += 1
        effective = self.state if self.armed and not self._pauses else PAUSED
        # packed first, then one 32-byte copy: pack_into would zero the record before
        # writing its fields, and a reader catching a rank descheduled in between saw
        # t = 0, a silence as long as the machine's uptime (a false hang verdict of a
        # chaos campaign). The copy's aligned 8-byte stores never tear a field.
        self._mm[:_REC.size] = _REC.pack(self.seq, self.iteration, effective, self.pid,
                                         time.monotonic())

    def work(self) -> None:
        self.beat(WORKING)

    def wait(self) -> None:
        self.beat(WAITING)

    # ---- seams --------------------------------------------------------------------
    def on_phase(self, name: str, begin: bool) -> None:
        """PipelineEvents' phases: a compute phase is work; whatever runs between compute
        phases (p2p, collectives, the step, the snapshot commit) is communication."""
        self.beat(WORKING if begin and name in WORK_PHASES else WAITING)

    def step(self) -> None:
        self.beat()

    def iteration_done(self, iteration: int) -> None:
        self.iteration, self.armed = iteration, True
        self.beat(WAITING)

    @contextmanager
    def paused(self):
        """A long legitimate phase (checkpoint save, validation): not judged. Nests."""
        self.pause()
        try:
            yield
        finally:
            self._pauses -= 1
            self.beat(WAITING)

    def pause(self) -> None:
        """Pause for good (shutdown), or the first half of :meth:`paused`."""
        self._pauses += 1
        self.beat()

    def close(self) -> None:
        if self._mm is None:
            return
        self._mm.close()
        self._mm = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ---- the watcher's side ------------------------------------------------------------
def read(p: str) -> dict | None:
    """The record, or None when absent, short or changing under the read (a rank that
    beats while we read is alive: reading twice is the consistency check)."""
    try:
        with open(p, "rb") as f:
            a = f.read(_REC.size)
            f.seek(0)
            b = f.read(_REC.size)
    except OSError:
        return None
    if len(a) < _REC.size or a != b:
        return None
    seq, iteration, state, pid, t = _REC.unpack(a)
    if seq == 0 or t <= 0.0 or state not in STATE_NAMES:  # not (yet) a whole beat
        return None
    return {"seq": seq, "iteration": iteration, "state": state, "pid": pid, "t": t}


def process_state(pid: int) -> str:
    """/proc's one-letter state in words (a SIGSTOPped rank shows as 'stopped')."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O",
            "T": "stopped", "t": "stopped by a tracer", "Z": "zombie"}.get(s, s)


def cpu_wait(pid: int) -> tuple[float, float, bool] | None:
    """(seconds on a CPU, seconds runnable but waiting for one, runnable now) of the
    process's main thread, the one that beats; None where the kernel does not say. The
    kernel adds a wait to the count only when it ends: a thread queued now shows as
    runnable with counts that do not move."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return int(ran) / 1e9, int(waited) / 1e9, state == "R"


class HangMonitor:
    """The node's ranks whose heartbeat has not moved for their limit, not counting the
    time they waited for a CPU since that beat (see the module docstring)."""

    def __init__(self, node_dir: str, ranks: list[int], pids: list[int], timeout: float):
        self.node_dir, self.timeout = node_dir, timeout
        self.ranks = dict(zip(ranks, pids))
        self._since: dict[int, dict] = {}  # rank: the CPU counts at its last beat

    def _starved(self, rank: int, pid: int, seq: int) -> float:
        """Seconds rank waited for a CPU since beat ``seq``: the counted waits, plus the
        one in progress. That one began after the last look at which the rank was seen
        running or asleep (its counts had not moved yet, or it was not runnable): counted
        from there, a look too early rather than too late (watcher time, whatever ``now``
        the caller judges with)."""
        c, t = cpu_wait(pid), time.monotonic()
        if c is None:
            return 0.0
        s = self._since.get(rank)
        if s is None or s["seq"] != seq:  # a new beat: the rank ran just now
            s = self._since[rank] = {"seq": seq, "waited": c[1], "counts": c[:2],
                                     "ran_by": t, "look": t, "first": (t, c[0])}
        elif c[:2] != s["counts"] or not c[2]:  # it ran (or slept) since the last look
            s["counts"], s["ran_by"] = c[:2], s["look"] if c[2] else t
        s["look"] = t
        return c[1] - s["waited"] + (t - s["ran_by"] if c[2] else 0.0)

    def _blocked(self, rank: int, starved: float) -> bool:
        """Asleep in the kernel since its beat: watched for at least BLOCKED_MIN_S, on a
        CPU or queued for one less than BLOCKED_SHARE of that time. A computing rank
        blocked like this waits inside its compute phase for a peer (a tensor-parallel
        all-reduce of a layer's forward): a victim, given the waiting limit. Sticky until
        the next beat: a victim woken by its failed collective (the culprit just killed)
        runs while it dies, and must not be judged a spinning culprit then (seed 23)."""
        s = self._since.get(rank)
        if s is None:
            return False
        if not s.get("blocked"):
            t0, ran0 = s["first"]
            watched = s["look"] - t0
            s["blocked"] = watched >= BLOCKED_MIN_S and \
                s["counts"][0] - ran0 + starved < BLOCKED_SHARE * watched
        return s["blocked"]

    def check(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        hung = []
        for rank, pid in self.ranks.items():
            rec = read(path(self.node_dir, rank))
            # another pid: a previous incarnation's file, not this worker's
            if rec is None or rec["pid"] != pid or rec["state"] == PAUSED:
                continue
            proc = process_state(pid)
            if proc in ("gone", "zombie"):  # dead, not hung: its agent sees the exit
                continue
            starved = self._starved(rank, pid, rec["seq"])
            waiting = self._blocked(rank, starved) or rec["state"] == WAITING
            if proc.startswith("stopped"):  # frozen (SIGSTOP): the culprit, whatever it
                waiting = False  # was doing, so it is killed before its waiting victims
            limit = self.timeout * (WAITING_FACTOR if waiting else 1)
            silent = now - rec["t"]
            if silent - starved >= limit:
                hung.append(dict(rec, rank=rank, silent=silent, starved=starved, limit=limit))
        return hung


def describe(h: dict, node: int, timeout: float) -> str:
    """The one line a hang is reported with (log and node status)."""
    starved = h.get("starved", 0.0)
    cpu = f"; {starved:.1f} s of it waiting for a CPU, not counted" if starved >= 0.05 else ""
    return (f"rank {h['rank']} (pid {h['pid']}, node {node}) made no progress for "
            f"{h['silent']:.1f} s while {STATE_NAMES[h['state']]}, last completed iteration "
            f"{h['iteration']} (limit {h['limit']:g} s, --reft-hang-timeout "
            f"{timeout:g}; process {process_state(h['pid'])}{cpu})")
