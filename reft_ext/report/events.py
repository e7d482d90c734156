"""REFT's log lines, for people and for programs.

``emit(event, text, **fields)`` writes the human line ``[REFT] <text>`` to stdout, as
REFT always has, and, when the environment variable ``REFT_EVENTS_FILE`` names a file,
appends the same fact as one JSON object per line::

    {"event": "recovered", "rank": 2, "time": 1718000000.1, "iteration": 4, "source": ...}

so that tests, dashboards and tools read fields instead of parsing sentences (whose
wording may change). ``rank`` is the ``RANK`` of the process that writes it (None outside
torchrun) unless the event names the rank it is about (a watcher reporting a hung rank).

Every process of a job (each rank, each node's watcher) appends to the same file: the
file is opened with O_APPEND and each object is written with one ``write()``, so lines
of different processes never interleave. It is created private (0600): events name
paths and run ids. The file is opened through its checked directory (reft_ext/safe_dir.py:
no link followed on the way or at the file) and written only if this user's own: a name
another user made first (a planted 0666 file, a link) is refused with one line, never
fed the job's events. No torch here: the watcher processes import this module too.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import time
from enum import Enum

ENV = "REFT_EVENTS_FILE"


def _plain(value):
    """JSON types only: enums as their values (Region.OWN -> "own"), tuples and sets as
    lists, dict keys as strings; anything else (a path object) as its str()."""
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _rank() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


_refused: set[str] = set()  # files refused once (said once per process)


def open_own(path: str, flags: int) -> int:
    """``os.open`` of an events (or goodput) file: through its directory's checked
    descriptor (a directory this user may make files in: its own, or a sticky one such as
    /tmp), never through a link, created exclusively (0600) or, when it exists, taken
    only if this user's. ``OSError`` (with a one-line reason) otherwise."""
    from reft_ext.safe_dir import PARENT, open_dir

    with open_dir(os.path.dirname(os.path.abspath(path)), kind=PARENT) as d:
        name = os.path.basename(path)
        if flags & os.O_CREAT:
            try:
                return d.open(name, flags | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
        fd = d.open(name, flags & ~os.O_CREAT)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PermissionError(errno.EACCES, f"{path} belongs to uid {st.st_uid} (or is not "
                              f"a plain file): not this user's, not used")
    return fd


def refuse_once(path: str, exc: BaseException, what: str = "events") -> None:
    """One line per file and process: why the job's records are not written there."""
    if path in _refused:
        return
    _refused.add(path)
    sys.stdout.write(f"[REFT] {what} file {path}: {exc}; its records are not written\n")
    sys.stdout.flush()


def record(event: str, *, into: str | None = None, **fields) -> dict | None:
    """Append one event to ``$REFT_EVENTS_FILE`` (``into``: to that file instead; nothing
    when neither names one; ``into``, not ``path``: events have a field of that name);
    returns the object written. A failed write never stops training: the event is lost,
    not the job."""
    path = into or os.environ.get(ENV)
    if not path:
        return None
    obj = {"event": event, "rank": _rank(), "time": time.time(), **_plain(fields)}
    line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    if path in _refused:
        return None
    try:
        fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as exc:
        refuse_once(path, exc)
        return None
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)
    return obj


def emit(event: str | None, text: str | None, *, prefix: str = "[REFT]", **fields) -> None:
    """The ``[REFT] <text>`` line (``prefix`` names another source, e.g. ``[AOR]``) (one
    write: ranks share a pipe, and print() writes the text and the newline separately,
    so two ranks' lines could run together), then the
    event. ``event`` None: the line alone; ``text`` None: the event alone (a fact a
    rank records that only rank 0 says in words)."""
    if text is not None:
        sys.stdout.write(f"{prefix} {text}\n")
        sys.stdout.flush()
    if event is not None:
        record(event, **fields)


def reft_print(msg: str, event: str | None = None, **fields) -> None:
    """One ``[REFT]`` line in one write; with ``event``, the same fact as fields in
    ``$REFT_EVENTS_FILE`` too. Here, at the bottom, so that every layer (the store
    included) reports through it without importing the snapshotter."""
    emit(event, msg, **fields)


def read(path: str) -> list[dict]:
    """Every event of a file written by :func:`record`, in the order written (a line a
    killed process left half-written is skipped). Read only through a checked directory,
    never through a link, and only if this user's own (``PermissionError`` otherwise)."""
    out = []
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        return out
    with os.fdopen(fd, "rb") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out
