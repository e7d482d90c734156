"""A failure that a restart cannot change: said once, by one rank, and never retried.

A bad flag, a --save that cannot be written or has no space left, a --reft-shm-dir too
small or another user's: every restart fails the same way, and each attempt of every
rank printing it buried the one line under usage blocks and peers' tracebacks (issue 59).
Such a failure ends the worker with :data:`EXIT_WILL_REPEAT` (or the trainer's checkpoint
error status, :data:`EXIT_CHECKPOINT`); the launchers (``python -m
reft_ext.cluster.torchrun``, tools/launch_nodes.py, the in-process supervisor) see the
status and do not restart. The rank that says it marks the job stopped in the job's
store (:func:`stop`): a peer whose collective then fails on the closed connection finds
the mark (:func:`stopped_by_peer`) and ends with the same status, silently.
"""

from __future__ import annotations

import os
import sys

EXIT_WILL_REPEAT = 2  # argparse's usage status: flags, places, space
EXIT_CHECKPOINT = 3   # the trainer's CheckpointError: a --load or --save that is refused
WILL_REPEAT = frozenset((EXIT_WILL_REPEAT, EXIT_CHECKPOINT))
_KEY = "reft/job-stopped"


def _store():
    """The job's store once torch.distributed is up (else None)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (a store that is gone: nobody to tell)
        pass
    return None


def is_first_rank() -> bool:
    """The node's first rank, or a process started alone: who says a failure before
    torch.distributed is up (the places checked may be the node's own: one line per
    node, from the launcher's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0


def say_once(msg: str) -> bool:
    """Write ``error: msg`` to stderr if no other rank said the job's stop before (the
    job's store counts them; without a store, the node's first rank says it). True when
    written."""
    store = _store()
    if store is not None:
        try:
            first = store.add(_KEY + "/said", 1) == 1
            store.set(_KEY, msg.encode()[:4096])
        except Exception:  # noqa: BLE001
            first = is_first_rank()
    else:
        first = is_first_rank()
    if first:
        sys.stderr.write(f"error: {msg}\n")  # one write: ranks of a node share stderr
    sys.stderr.flush()
    sys.stdout.flush()
    return first


def stopped_by_peer() -> bool:
    """Another rank ended the job with a failure that will repeat (:func:`say_once`)."""
    store = _store()
    if store is None:
        return False
    try:
        return store.check([_KEY])
    except Exception:  # noqa: BLE001
        return False


def will_repeat(codes) -> int | None:
    """The first exit status of ``codes`` that says a restart would fail the same way."""
    for c in codes:
        if c in WILL_REPEAT:
            return c
    return None
