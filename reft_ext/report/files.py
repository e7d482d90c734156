"""Files the project writes by name (logs, events, traces, reports), never through a link.

A name in a directory another user can write (a shared run or scratch directory, /tmp)
may be a symbolic link planted there: ``open(path, "w")`` follows it and overwrites the
file it names, as the job's user. Every such write goes through here: opened
``O_NOFOLLOW`` (a planted link fails with ``ELOOP``), or written to a fresh temporary of
an unpredictable name (``O_EXCL|O_NOFOLLOW``) and renamed into place. Plain Python.
"""

from __future__ import annotations

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
    """``path`` replaced by ``text`` in one step: a fresh temporary next to it, of an
    unpredictable name, created ``O_EXCL|O_NOFOLLOW``, then renamed over ``path``."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 perm)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
