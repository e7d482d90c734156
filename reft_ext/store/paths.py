"""Where a job's REFT files live on a node: the one place that spells their names.

    <shm>/reft-<job>/                          the job's private parent on this host (0700,
                                              this user's): nothing of the job's is made at
                                              a name of the shared directory itself
        node<n>/                               a failure domain's directory (its segments:
                                              slots, commit pointers, heartbeats, AOR)
        node<n>.meta/                          beside it, not inside (it outlives a wipe of
                                              the node's memory; see cluster/status.py),
                                              private (0700, this user's) as the node's:
            status.json  watcher.pid  handover-<key>.json

Nothing is read or written at a world-creatable name of the shared directory itself:
whoever else can write there could plant a file (a FINISHED status, a pid file) that
another user's job would trust or fail on. :func:`ensure_private` creates such a
directory or refuses one that is not this user's; :func:`read_private` reads a file
only from a private directory, only when it is this user's own regular file.

The private parent is what keeps a lost node's directory, once wiped, from being made
by another user who read the job id (a watcher's command line, a listing of /dev/shm):
only the parent's name is in the shared directory, made before anything else of the job
and removed with the job's last segment (:func:`remove_parent`). A default job id has
a random part (reft_ext/cluster/run_id.py), so the parent cannot be made first either.

A failure domain is addressed as the segment namespace ``<job>/node<n>`` (:func:`domain`)
at ``<shm>/reft-<job>/node<n>`` (:func:`job_dir`). Plain Python (no torch): the node's
watcher, the launcher and ``tools/reft_status.py`` import it.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import stat

from reft_ext import safe_dir

PREFIX = "reft-"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
SIDE = ".meta"  # <shm>/reft-<job>/node<n>.meta: the node's private side directory


def default_base_dir() -> str:
    return os.environ.get("REFT_SHM_DIR") or "/dev/shm"


def check_name(s: str, what: str) -> None:
    """A segment namespace or file name: no '/', no leading '.' (never escapes the base)."""
    if not isinstance(s, str) or not _NAME_RE.match(s):
        raise ValueError(f"{what} {s!r} must match {_NAME_RE.pattern} (no '/', no leading '.')")


def job_dir(job_id: str, base_dir: str | None = None) -> str:
    """The directory of the segment namespace ``job_id``: ``<base>/reft-<job_id>``, or
    for a failure domain's ``<job>/node<n>`` (:func:`domain`) ``<base>/reft-<job>/node<n>``
    (the part before the ``/`` names the job's private parent)."""
    parts = job_id.split("/") if isinstance(job_id, str) else [job_id]
    if len(parts) > 2:
        raise ValueError(f"job_id {job_id!r}: at most one '/' (<job>/node<n>)")
    for part in parts:
        check_name(part, "job_id")
    return os.path.join(base_dir or default_base_dir(), PREFIX + parts[0], *parts[1:])


def parent_of(job_id: str, base_dir: str | None = None) -> str | None:
    """The private parent of the namespace ``job_id`` (``<base>/reft-<job>`` for a
    ``<job>/node<n>``), None for a namespace without one."""
    if "/" not in job_id:
        return None
    return job_dir(job_id.split("/")[0], base_dir)


def domain(job: str, node) -> str:
    """The segment namespace of one failure domain (``node`` may be a glob pattern)."""
    return f"{job}/node{node}"


def job_parent(shm_dir: str, job: str) -> str:
    """``<shm>/reft-<job>``: the job's private parent on this host."""
    return job_dir(job, shm_dir)


def node_dir(shm_dir: str, job: str, node: int) -> str:
    """``<shm>/reft-<job>/node<n>``: the failure domain's shared-memory directory."""
    return job_dir(domain(job, node), shm_dir)


def side_dir(shm_dir: str, job: str, node) -> str:
    """``<shm>/reft-<job>/node<n>.meta``: the node's private side directory, next to its
    shared-memory directory (it stays when the node's memory is wiped). Not
    name-checked: readers of a foreign job id must get "absent", not an error."""
    return os.path.join(shm_dir, PREFIX + job, f"node{node}{SIDE}")


def remove_parent(shm_dir: str, job: str) -> None:
    """Remove the job's parent once nothing is left in it (the last node's end)."""
    try:
        os.rmdir(os.path.join(shm_dir, PREFIX + job))
    except OSError:
        pass  # another node's directory or side files still there, or gone already


def node_file(shm_dir: str, job: str, node: int, name: str) -> str:
    """A file of the node's side directory (``name`` e.g. ``status.json``)."""
    return os.path.join(side_dir(shm_dir, job, node), name)


def side_glob(shm_dir: str, job: str, name: str) -> str:
    """Glob pattern of one file (``name``, a glob pattern itself) in every node's side
    directory of a job."""
    return os.path.join(shm_dir, PREFIX + glob.escape(job), f"node*{SIDE}", name)


def side_node_of(path: str, job: str) -> int | None:
    """The node index of a path matched by :func:`side_glob`, else None."""
    return node_of(os.path.dirname(path), job, SIDE)


class PrivateDirError(PermissionError):
    """A directory REFT writes into or reads from is not this user's private one."""

    def __str__(self) -> str:  # the one-line message, without "[Errno 13]"
        return self.strerror or super().__str__()


def private_problem(path: str) -> str | None:
    """Why ``path`` is not this user's private directory (absent, not a directory, a
    symbolic link, another user's, writable by group or others, or below a directory
    another user could swap: reft_ext/safe_dir.py), or None when it is."""
    return safe_dir.problem(path)


def ensure_private(path: str, what: str, advice: str, *, fix_mode: bool = True) -> str:
    """Create ``path`` (0700, through its parents' descriptors), or take an existing one
    only if it is this user's directory below safe ones (safe_dir.open_dir):
    :class:`PrivateDirError`, one line naming it, otherwise. ``fix_mode``: a directory of
    this user open to group or others is made 0700 (else refused)."""
    try:
        safe_dir.open_dir(path, create=True, fix_mode=fix_mode).close()
    except safe_dir.UnsafePathError as exc:
        raise PrivateDirError(errno.EACCES, f"{what}: {path} {exc.reason}: not used. "
                              f"{advice}") from None
    except NotADirectoryError:
        raise PrivateDirError(errno.EACCES, f"{what}: {path} is not a directory (or one "
                              f"above it is not): not used. {advice}") from None
    return path


_HELD_ADVICE = ("Start this job with another --reft-job-id (or --reft-shm-dir), or remove "
                "it if the job that made it is over")


def ensure_side_dir(shm_dir: str, job: str, node: int) -> str:
    """The node's side directory, created private or refused (:func:`ensure_private`),
    its job's parent first."""
    ensure_private(job_parent(shm_dir, job), "--reft-shm-dir", _HELD_ADVICE)
    return ensure_private(side_dir(shm_dir, job, node), "--reft-shm-dir", _HELD_ADVICE)


def read_private(path: str) -> str | None:
    """The text of ``path`` if it is this user's own regular file (not a symbolic link,
    not writable by group or others) in this user's private directory, opened through
    that directory's checked descriptor; else None, as for an absent file: a file another
    user could have planted is never trusted."""
    try:
        d = safe_dir.open_dir(os.path.dirname(path) or ".")
    except (OSError, ValueError):
        return None
    try:
        fd = d.open(os.path.basename(path), os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    finally:
        d.close()
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
                st.st_mode & 0o022:
            return None
        with os.fdopen(os.dup(fd), "r") as f:
            return f.read()
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def node_glob(shm_dir: str, job: str, suffix: str = "") -> str:
    """Glob pattern of every node's directory (``suffix=""``) or file of one job."""
    return os.path.join(shm_dir, PREFIX + glob.escape(job), f"node*{suffix}")


def node_of(path: str, job: str, suffix: str = "") -> int | None:
    """The node index in a path matched by :func:`node_glob`, else None."""
    m = re.search(rf"{PREFIX}{re.escape(job)}/node(\d+){re.escape(suffix)}$", path)
    return int(m.group(1)) if m else None


def job_of(name: str, suffix: str) -> str | None:
    """The job id in a path ``.../reft-<job>/node<n><suffix>``, else None."""
    m = re.match(rf"^{PREFIX}(.*)/node\d+{re.escape(suffix)}$",
                 "/".join(os.path.normpath(name).split("/")[-2:]))
    return m.group(1) if m else None


def job_parents(shm_dir: str) -> list[str]:
    """The job ids with a parent directory in ``shm_dir`` (any user's: the caller
    checks ownership before using one)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(n[len(PREFIX):] for n in names
                  if n.startswith(PREFIX) and _NAME_RE.match(n[len(PREFIX):] or "-")
                  and os.path.isdir(os.path.join(shm_dir, n))
                  and not os.path.islink(os.path.join(shm_dir, n)))
