"""Small files that are either absent, the old text or the new text, never torn.

Manifests, commit pointers, node status files and shrink hand-over notes are written
here: a temporary file next to the target (mode 0600: another user never reads a job's
state), then ``os.replace``, which is atomic within one filesystem. The temporary's name
is unpredictable and it is created O_EXCL|O_NOFOLLOW: a file or symbolic link planted in
the directory is never opened, let alone written through. Plain Python (no
torch): the node's watcher and the launcher use it.
"""

from __future__ import annotations

import errno
import os
import secrets


def tmp_name(path: str) -> str:
    """A fresh, unpredictable temporary name next to ``path``."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def write_atomic(path: str, text: str, *, durable: bool = False,
                 per_writer: bool = False) -> None:
    """Replace ``path`` by ``text`` in one step.

    durable: fsync before the rename (the snapshot manifests: the rename must not become
    visible before the bytes it describes). per_writer: kept for the callers that several
    processes may write at once (a node's status: the launcher and a rank); every
    temporary is unique now (:func:`tmp_name`), created O_EXCL|O_NOFOLLOW, so no writer
    ever opens another's temporary or a planted one."""
    del per_writer  # every temporary is per writer (and per call)
    tmp = tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(path, text) from exc
        raise  # nothing created: nothing to remove (a planted name is not ours)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
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
