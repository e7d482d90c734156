"""Test machinery for REFT (fault injection), kept out of the production objects.

Production code reaches it through one narrow injection point, :func:`fault_point`: a
named moment ("snapshot-write": halfway through writing a snapshot) or a request from
the trainer's ``--inject-fault`` ("node-loss", "corrupt"). Nothing happens unless a run
started with ``--inject-fault`` installed an observer (reft_ext/testing/faults.py); this
module imports nothing, so production code pays one attribute test per call.
"""

from __future__ import annotations

from typing import Callable

_observer: Callable[..., None] | None = None


def set_fault_observer(observer: Callable[..., None] | None) -> None:
    """Install (or with None remove) the process's one observer: ``observer(point,
    **info)``. One process is one rank, so one observer serves the whole process."""
    global _observer
    _observer = observer


def fault_point(point: str, **info) -> None:
    """Production code passing ``point``: the observer, if any, may damage state, kill
    the process or do nothing."""
    if _observer is not None:
        _observer(point, **info)
