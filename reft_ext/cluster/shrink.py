"""What REFT's host memory does when the start-up health check (health.py) fails a node
and the job shrinks or stops (docs/nodes.md). The trainer's call site
(megatron/training/startup_health_check.py) decides who stays and who leaves; what that
means for the shared memory, and the note REFT-load reads after the restart
(reft_ext/load/reshard.py), is decided here: the handover note's format is this module's,
which REFT-load imports (the job's watching layer sits below loading).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket

from reft_ext.cluster import status as node_status
from reft_ext.config import ReftConfig
from reft_ext.store import paths
from reft_ext.store.atomic import write_atomic
from reft_ext.store.paths import node_dir


def mark_unhealthy(cfg: ReftConfig, node: int, ranks: list[int], why: str) -> None:
    """The node's own status file says it failed the check (call on one rank of the
    node: the file has one writer)."""
    node_status.write(cfg.shm_dir, cfg.job_id, node, node_status.UNHEALTHY, ranks=ranks,
                      detail=f"failed the health check ({why})")


def leave_job(cfg: ReftConfig, node: int) -> None:
    """A failed node leaves the job: its host memory goes with it (another node's ranks
    may take its index, and so its shared-memory directory, in the smaller job). Call
    on the node's first rank."""
    shutil.rmtree(node_dir(cfg.shm_dir, cfg.job_id, node), ignore_errors=True)


def hand_over(cfg: ReftConfig, rank: int, node: int, world_size: int) -> None:
    """A healthy rank stays for the smaller job: who it was in this one, for REFT-load
    after the restart (reft_ext/load/reshard.py reads and removes the note with
    :func:`take_handover`). Nothing when snapshots are off (nothing in memory to
    reshard)."""
    if not cfg.enabled:
        return
    write_handover(cfg.shm_dir, cfg.job_id, rank, node, world_size)


# ---- the handover note: written here, read by REFT-load (reft_ext/load/reshard.py) -----
def _key() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    return f"{host}-{os.getppid()}-{os.environ.get('LOCAL_RANK', '0')}"


def write_handover(shm_dir: str, job: str, rank: int, node: int, world_size: int) -> str:
    """This rank's place in the job it is leaving (in the old node's private side
    directory, next to its shared-memory directory, so the launcher's clean-up of
    ``reft-<job>`` removes a stale note too)."""
    paths.ensure_side_dir(shm_dir, job, node)
    path = paths.node_file(shm_dir, job, node, f"handover-{_key()}.json")
    write_atomic(path, json.dumps({"rank": rank, "node": node, "world_size": world_size}))
    return path


def take_handover(shm_dir: str, job: str) -> dict | None:
    """This rank's note from the attempt before, removed: a later restart of the same
    agent must not take it for a fresh one."""
    found = None
    for p in glob.glob(paths.side_glob(shm_dir, job, f"handover-{glob.escape(_key())}.json")):
        d = os.path.dirname(p)
        if paths.private_problem(d) is not None:
            continue  # another user's directory: neither trusted nor touched
        text = paths.read_private(p)  # None: not this user's own file
        try:
            note = json.loads(text) if text is not None else None
        except ValueError:
            note = None
        if isinstance(note, dict):
            found = note
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(d)  # the side directory, once empty (no status left in it)
            paths.remove_parent(shm_dir, job)
        except OSError:
            pass
    return found
