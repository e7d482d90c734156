"""Mapped segments handed from a failed generation's snapshot store to the next one
of the same process (an in-process restart).

A survivor abandons its REFT session and opens a new one on the same segments. Closing
them and attaching them again maps every page again (``MAP_POPULATE``: 0.45 s for the
three slots of a 24-layer rank on this host, on the survivors' path to REFT-load). So
the abandoned store hands its open segments over here, and the new store claims each by
its path instead of attaching it; what is not claimed once the new store has reserved
its segments is closed (:func:`release`). A thread may still read the handed-over
mappings (REFT-load's first checksums, begun at the abandon: reft_ext/load/preverify.py):
a claim or a release waits for it, since the claimer may resize a mapping and a release
unmaps it.

A claim checks that the path still names the file that was mapped (device and inode
of a fresh ``lstat``, a regular file of this user): a segment removed or replaced in the
meantime (another run's cleanup, a user) is closed and attached anew by the caller.
"""

from __future__ import annotations

import os
import stat
import threading

from reft_ext.store.shm import ShmSegment

_handed: dict[str, ShmSegment] = {}
_lock = threading.Lock()
_reader: threading.Thread | None = None  # still reading the handed-over mappings


def hand_over(segments, reader: threading.Thread | None = None) -> None:
    """Keep these open segments (of an abandoned store) for this process's next store;
    ``reader``: a thread still reading them, waited for before any is claimed or closed."""
    global _reader
    _reader = reader
    with _lock:
        for seg in segments:
            old = _handed.pop(seg.path, None)
            if old is not None and old is not seg:
                old.close()
            _handed[seg.path] = seg


def claim(path: str) -> ShmSegment | None:
    """The handed-over segment mapped from ``path`` if the path still names that file,
    else None (a stale one is closed)."""
    _wait_reader()
    with _lock:
        seg = _handed.pop(path, None)
    if seg is None:
        return None
    try:
        now, mapped = os.lstat(path), os.fstat(seg.fileno())
        same = (stat.S_ISREG(now.st_mode) and now.st_uid == os.getuid() and
                (now.st_dev, now.st_ino) == (mapped.st_dev, mapped.st_ino))
    except (OSError, ValueError):
        same = False
    if not same:
        seg.close()
        return None
    return seg


def release() -> int:
    """Close what no new store claimed; returns how many."""
    _wait_reader()
    with _lock:
        left = list(_handed.values())
        _handed.clear()
    for seg in left:
        seg.close()
    return len(left)


def _wait_reader() -> None:
    global _reader
    r, _reader = _reader, None
    if r is not None:
        r.join()


def held() -> int:
    """How many segments wait to be claimed."""
    return len(_handed)
