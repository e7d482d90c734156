"""Where a job's REFT files live on a node: the one place that spells their names.

    <shm>/reft-<job>-node<n>/                  a failure domain's directory (its segments:
                                              slots, commit pointers, heartbeats, AOR)
    <shm>/reft-<job>-node<n>.status.json       beside it, not inside (see cluster/status.py)
    <shm>/reft-<job>-node<n>.watcher.pid
    <shm>/reft-<job>-node<n>.handover-<key>.json

A failure domain is addressed as the segment namespace ``<job>-node<n>`` (:func:`domain`)
inside ``<shm>/reft-<namespace>`` (:func:`job_dir`). Plain Python (no torch): the node's
watcher, the launcher and ``tools/reft_status.py`` import it.
"""

from __future__ import annotations

import glob
import os
import re

PREFIX = "reft-"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def default_base_dir() -> str:
    return os.environ.get("REFT_SHM_DIR") or "/dev/shm"


def check_name(s: str, what: str) -> None:
    """A segment namespace or file name: no '/', no leading '.' (never escapes the base)."""
    if not isinstance(s, str) or not _NAME_RE.match(s):
        raise ValueError(f"{what} {s!r} must match {_NAME_RE.pattern} (no '/', no leading '.')")


def job_dir(job_id: str, base_dir: str | None = None) -> str:
    """The directory of the segment namespace ``job_id``: ``<base>/reft-<job_id>``."""
    check_name(job_id, "job_id")
    return os.path.join(base_dir or default_base_dir(), PREFIX + job_id)


def domain(job: str, node) -> str:
    """The segment namespace of one failure domain (``node`` may be a glob pattern)."""
    return f"{job}-node{node}"


def node_dir(shm_dir: str, job: str, node: int) -> str:
    """``<shm>/reft-<job>-node<n>``: the failure domain's shared-memory directory."""
    return job_dir(domain(job, node), shm_dir)


def node_file(shm_dir: str, job: str, node: int, suffix: str) -> str:
    """A file next to the node's directory (``suffix`` e.g. ``.status.json``): it stays
    when the node's memory is wiped. Not name-checked: readers of a foreign job id must
    get "absent", not an error."""
    return os.path.join(shm_dir, PREFIX + domain(job, node) + suffix)


def node_glob(shm_dir: str, job: str, suffix: str = "") -> str:
    """Glob pattern of every node's directory (``suffix=""``) or file of one job."""
    return os.path.join(shm_dir, PREFIX + domain(glob.escape(job), "*") + suffix)


def node_of(path: str, job: str, suffix: str = "") -> int | None:
    """The node index in a path matched by :func:`node_glob`, else None."""
    m = re.search(rf"{PREFIX}{re.escape(job)}-node(\d+){re.escape(suffix)}$", path)
    return int(m.group(1)) if m else None


def job_of(name: str, suffix: str) -> str | None:
    """The job id in a file name ``reft-<job>-node<n><suffix>``, else None."""
    m = re.match(rf"^{PREFIX}(.*)-node\d+{re.escape(suffix)}$", os.path.basename(name))
    return m.group(1) if m else None
