"""Files the project writes by name (logs, events, traces, reports), never through a link.

A name in a directory another user can write (a shared run or scratch directory, /tmp)
may be a symbolic link planted there: ``open(path, "w")`` follows it and overwrites the
file it names, as the job's user. Every such write goes through here: opened
``O_NOFOLLOW`` (a planted link fails with ``ELOOP``), or written to a fresh temporary of
an unpredictable name (``O_EXCL|O_NOFOLLOW``) and renamed into place. Plain Python.
"""

from __future__ import annotations

import errno
import os
import secrets


def open_nofollow(path: str, mode: str = "w", perm: int = 0o600, **kwargs):
    """``open(path, mode)`` for writing ("w", "a", with "b" for bytes), never through a
    symbolic link: a link at ``path`` raises ``OSError`` (``ELOOP``) instead of having
    the file it names written. A file made here is ``perm`` (0600 by default)."""
    if mode.replace("b", "") not in ("w", "a"):
        raise ValueError(f"open_nofollow: mode {mode!r} (w or a, with b)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    return os.fdopen(os.open(path, flags, perm), mode, **kwargs)


def replace_with(path: str, text: str, perm: int = 0o600) -> None:
    """``path`` replaced by ``text`` in one step (:func:`write_atomic`)."""
    write_atomic(path, text, perm=perm)


def tmp_name(path: str) -> str:
    """A fresh, unpredictable temporary name next to ``path``."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def write_atomic(path: str, text: str, *, durable: bool = False,
                 per_writer: bool = False, perm: int = 0o600) -> None:
    """Replace ``path`` by ``text`` in one step.

    durable: fsync before the rename (the snapshot manifests: the rename must not become
    visible before the bytes it describes). per_writer: kept for the callers that several
    processes may write at once (a node's status: the launcher and a rank); every
    temporary is unique now (:func:`tmp_name`), created O_EXCL|O_NOFOLLOW, so no writer
    ever opens another's temporary or a planted one. perm: the file's mode (0600: another
    user never reads a job's state)."""
    del per_writer  # every temporary is per writer (and per call)
    tmp = tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, perm)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(path, text) from exc
        raise  # nothing created: nothing to remove (a planted name is not ours)
    try:
        try:
            data = memoryview(text.encode())
            while data:  # (a raw write: no text and buffer layers for a few KB)
                data = data[os.write(fd, data):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:  # the target is untouched; no half-written temporary left
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno == errno.ENOSPC:  # a full /dev/shm (or disk): say where and what
            raise _no_space(path, text) from exc
        raise
    try:
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _no_space(path: str, text: str) -> OSError:
    return OSError(errno.ENOSPC, f"no space left on the filesystem of "
                   f"{os.path.dirname(path) or '.'} to write {os.path.basename(path)} "
                   f"({len(text)} bytes); the previous version is intact. Free "
                   f"space there (df -h) and restart")
