"""Threads told to stop are joined with a bound; one that outlives its join is reported
(a ``[REFT] warning`` line and a ``thread_alive`` event), never silently left running:
it may still hold what its owner is about to free or reuse."""

from __future__ import annotations

import threading

from reft_ext.report.events import emit


def join_or_warn(thread: threading.Thread, timeout_s: float, what: str, **fields) -> bool:
    """Join ``thread`` for at most ``timeout_s`` seconds; True when it has ended. False (and
    the warning said) when it is still alive: the caller must not free what it uses."""
    thread.join(timeout_s)
    if not thread.is_alive():
        return True
    emit("thread_alive", f"warning: {what} (thread {thread.name}) still running "
         f"{timeout_s:g} s after it was told to stop; going on without it",
         thread=thread.name, what=what, timeout_s=timeout_s, **fields)
    return False

