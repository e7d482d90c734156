"""Small files that are either absent, the old text or the new text, never torn.

Manifests, commit pointers, node status files and shrink hand-over notes are written
here: a temporary file next to the target (mode 0600: another user never reads a job's
state), then ``os.replace``, which is atomic within one filesystem. Plain Python (no
torch): the node's watcher and the launcher use it.
"""

from __future__ import annotations

import errno
import os


def write_atomic(path: str, text: str, *, durable: bool = False,
                 per_writer: bool = False) -> None:
    """Replace ``path`` by ``text`` in one step.

    durable: fsync before the rename (the snapshot manifests: the rename must not become
    visible before the bytes it describes). per_writer: the temporary file is named after
    this process, for files that several processes may write at once (a node's status:
    the launcher and a rank); else ``<path>.tmp``, which a crashed writer's successor
    simply overwrites."""
    tmp = f"{path}.{os.getpid()}.tmp" if per_writer else f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
            raise OSError(errno.ENOSPC, f"no space left on the filesystem of "
                          f"{os.path.dirname(path) or '.'} to write {os.path.basename(path)} "
                          f"({len(text)} bytes); the previous version is intact. Free "
                          f"space there (df -h) and restart") from exc
        raise
    os.replace(tmp, path)
