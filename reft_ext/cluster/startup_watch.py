"""The in-process supervisor's watch over a generation's start-up (or rejoin): from its
publication until every rank has finished an iteration in it.

Training is watched by the ranks' heartbeats (reft_ext/cluster/heartbeat.py), armed after
the first iteration; before that a generation's ranks beat nowhere, and a start-up
collective that one rank never enters (or a peer that died where nobody noticed) would
hold the others for the whole ``--distributed-timeout-minutes``. So the supervisor
watches start-ups itself, with ``--reft-hang-timeout``: a generation whose ranks, all of
them, made no progress for WAITING_FACTOR x that timeout (the limit of ranks waiting
for peers) is aborted like a failed one, and the next generation starts.

Progress is what a stalled start-up cannot fake: any rank consuming CPU (a cold
replacement importing, building its model, REFT-load checksumming; read from
``/proc/<pid>/task/*/stat`` for the workers this host runs, gloo's TCP loop threads
left out: they wake on timeouts of their own), or a new start-up mark in the store (the
``trained`` marks). A rank blocked in a collective sleeps in the kernel otherwise and
consumes none, so a generation where every rank waits for another stands out within the
limit, however loaded the host: a starved rank still gets CPU ticks. Workers whose CPU
this host cannot read (the node pool's, on other hosts) count as progressing, so a
multi-node start-up is left to the ranks' own timeouts (docs/nodes.md).

Plain Python (no torch): the supervisor's monitor calls it every poll.
"""

from __future__ import annotations

import os
import time

from reft_ext.cluster.heartbeat import WAITING_FACTOR

CHECK_S = 0.5          # how often the monitor looks (CPU and marks)
CPU_EPS_S = 0.005      # CPU seconds below this, summed over the ranks, is no progress
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# threads that use CPU while their process waits: gloo's TCP loop wakes on its own
# timeouts (about 10 ms of CPU a second per group set, measured on a rank blocked in a
# barrier); not progress
IDLE_THREADS = ("gloo_tcp_loop",)


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of process ``pid``'s threads but the IDLE_THREADS, or None (gone,
    not readable)."""
    if not pid:
        return None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ticks = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue  # a thread that ended meanwhile
        if head.partition("(")[2] in IDLE_THREADS:
            continue
        fields = rest.split()
        try:
            ticks += int(fields[11]) + int(fields[12])
        except (ValueError, IndexError):
            continue
    return ticks / TICKS


def stopped(pid: int | None) -> bool:
    """Is process ``pid`` stopped (SIGSTOP: /proc state T)? It cannot abort itself."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class StartupWatch:
    """begin(gen) when a generation is published; check(...) on every poll until done()."""

    def __init__(self, hang_timeout: float):
        self.limit = WAITING_FACTOR * hang_timeout  # 0: off
        self.gen: int | None = None
        self.finished = True
        self._last = self._next = 0.0
        self._cpu: float | None = None
        self._marks = -1

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def begin(self, gen: int) -> None:
        """Generation ``gen`` was published: its start-up is watched from now."""
        self.gen, self.finished = gen, not self.enabled
        self._last = time.monotonic()
        self._next, self._cpu, self._marks = 0.0, None, -1

    def due(self) -> bool:
        """Time for the next look (the monitor polls every 20 ms; reading every rank's
        marks from the store that often would load it for nothing)."""
        return not self.finished and time.monotonic() >= self._next

    def check(self, cpu: list[float | None], marks: int, ranks: int) -> float | None:
        """One look: each rank's CPU seconds (None: not readable here) and how many
        start-up marks the generation has. None while it progresses (or is done: every
        one of ``ranks`` marked); else the seconds it has been silent, once over the
        limit."""
        now = time.monotonic()
        self._next = now + CHECK_S
        if marks >= ranks:
            self.finished = True
            return None
        total = None if any(c is None for c in cpu) else sum(cpu)
        moved = total is None or self._cpu is None or total - self._cpu >= CPU_EPS_S
        if moved or marks > self._marks:
            self._last = now
        self._cpu, self._marks = total, marks
        silent = now - self._last
        return silent if silent > self.limit else None

    def reason(self, silent: float) -> str:
        return (f"generation {self.gen}'s start-up made no progress for {silent:.0f} s (no "
                f"rank used CPU or marked a step; limit {self.limit:g} s: "
                f"{WAITING_FACTOR} x --reft-hang-timeout)")
