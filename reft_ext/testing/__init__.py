"""Test machinery for REFT (fault injection), kept out of the production objects.

Production code reaches it through one narrow injection point, :func:`fault_point`: a
named moment of a run (``fault_point("commit", iteration=it)``: the phases of
``--inject-fault ...@PHASE``, listed in fault_specs.py), a request from the
``--inject-fault`` observer ("node-loss", "corrupt") or a resource about to be taken
("shm-reserve": reft_ext/store/shm.py reserving pages). Nothing happens unless a run
started with ``--inject-fault`` installed an observer (fault_observer.py's FaultObserver,
installed by the trainer, which hands the REFT damage to faults.py); this module imports
nothing, so production code pays one ``None`` test per call.

The contract of a fault point: ``fault_point(point, iteration=ITER, **info)``, with
ITER the iteration the moment belongs to (keyword). The observer may damage state, kill
the process (the call then never returns), raise (``shm-reserve``: an ``OSError``),
return a replacement (``load-send``: a damaged copy of the payload a rank is about to
send, reft_ext/load/received.py) or do nothing; it fires a fault at most once per
process.
"""

from __future__ import annotations

from typing import Callable

_observer: Callable[..., None] | None = None


def set_fault_observer(observer: Callable[..., None] | None) -> None:
    """Install (or with None remove) the process's one observer: ``observer(point,
    **info)``. One process is one rank, so one observer serves the whole process."""
    global _observer
    _observer = observer


def get_fault_observer() -> Callable[..., None] | None:
    """The installed observer (None in production)."""
    return _observer


def fault_point(point: str, **info):
    """Production code passing ``point``: the observer, if any, may damage state, kill
    the process, raise, return a replacement or do nothing (None)."""
    if _observer is not None:
        return _observer(point, **info)
    return None
