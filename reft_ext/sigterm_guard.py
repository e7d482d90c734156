"""SIGTERM (a preemption, a scheduler's time limit) while REFT trains: the snapshot in
flight is committed before the rank terminates, so the node watcher's flush holds the
last completed iteration and the next job resumes there (README, docs/operations.md
"Preemption and time limits"). Used by reft_ext/session.py, which marks when a snapshot
is in flight."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from reft_ext.report.events import record, reft_print

__all__ = ["SigtermGuard"]


class SigtermGuard:
    """SIGTERM (a preemption) while a snapshot is in flight: the rank finishes and
    commits it, then terminates, so the node watcher flushes the last completed
    iteration (under HAS the snapshot of i is committed during i+1, before i+1's step:
    docs/has.md). In flight means from the end of an iteration that is snapshotted (the
    session's after_step) to the commit of its snapshot. Otherwise SIGTERM terminates
    at once, as by default. Installed only where SIGTERM has no handler yet
    (--exit-signal-handler saves a checkpoint its own way), while the session trains.

    A Python handler runs only when the main thread is back in the interpreter: one
    stuck in a collective whose peer died (torchrun's SIGTERM after a failure) would
    never run it. A thread woken through the signal wakeup fd ends the process at once
    when nothing is in flight, else after :meth:`grace` (the commit could not finish)."""

    GRACE_MAX_S = 25.0  # within torchrun's 30 s between its SIGTERM and SIGKILL

    def __init__(self, session):
        self.session = session
        self.received = False
        self.stepping = False  # a completed iteration to be snapshotted, not yet begun
        self.busy = False      # the snapshot in flight being drained and committed
        self.installed = False
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def install(self) -> None:
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._previous_fd = signal.set_wakeup_fd(w)
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread: the default action stays
            return
        self._pipe, self.installed = (r, w), True
        threading.Thread(target=self._watch, args=(r,), name="reft-sigterm",
                         daemon=True).start()

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(self._previous_fd)
        r, w = self._pipe
        with contextlib.suppress(OSError):
            os.write(w, b"\0")  # wakes the thread: it ends and closes its end
        with contextlib.suppress(OSError):
            os.close(w)

    def grace(self) -> float:
        """Twice the median iteration, for the commit of the snapshot in flight."""
        try:
            its = sorted(self.session.iteration_s)
        except RuntimeError:  # appended to by the main thread meanwhile
            its = []
        return min(self.GRACE_MAX_S, 2.0 + 2 * (its[len(its) // 2] if its else 5.0))

    def _watch(self, r: int) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data or 0 in data:
                    return  # uninstalled
                if signal.SIGTERM in data:
                    break
            deadline = time.monotonic() + (self.grace() if self._in_flight() else 0.0)
            while time.monotonic() < deadline and self.installed:
                time.sleep(0.05)
            if self.installed:  # the main thread has not terminated (nor the session ended)
                sys.stdout.flush()
                os._exit(128 + signal.SIGTERM)
        finally:
            with contextlib.suppress(OSError):
                os.close(r)

    def _in_flight(self) -> bool:
        snap = self.session.snap
        return self.busy or self.stepping or (snap is not None and snap.pending is not None)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        self.received = True
        if not self._in_flight():
            self.terminate(None)

    def safe_point(self) -> None:
        """Nothing in flight here: a SIGTERM received meanwhile terminates now."""
        if self.received and not self._in_flight():
            self.terminate(self.session.snap.last.get("iteration"))

    def terminate(self, committed: int | None) -> None:
        self.uninstall()
        if committed is not None:
            s = self.session
            msg = (f"rank {s.adapter.rank}: SIGTERM: committed the snapshot of iteration "
                   f"{committed} first; terminating")
            if s.snap.signals.leader:  # one line per failure domain, an event per rank
                reft_print(msg)
            record("sigterm_committed", iteration=committed)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: killed by SIGTERM
        os._exit(128 + signal.SIGTERM)
