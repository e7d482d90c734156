"""This user's REFT host memory in a shared-memory directory: what is there, who uses it.

A normal end removes a job's ``<shm>/reft-<job>`` (reft_ext/store/paths.py); an abnormal
one leaves it (the launcher says so in one line), for the re-run of the same run to
resume from. What nobody will re-run stays until removed: tools/reft_status.py
``--list-shm`` lists it with its size and whether a process still maps or holds a file
of it, and ``--clean`` removes what no process uses. Only this user's private job
directories are listed or removed. Plain Python (no torch).
"""

from __future__ import annotations

import os
import re
import shutil

from reft_ext.cluster import status
from reft_ext.store import paths


def size(path: str) -> int:
    """Bytes of RAM the files below ``path`` take (their blocks; links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def users(path: str) -> list[int]:
    """Processes that map a file below ``path`` or hold one open (this user's: /proc of
    others is not readable, and their processes cannot open a 0700 directory of ours)."""
    prefix = path.rstrip("/") + "/"
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if prefix in f.read():
                    found.append(int(pid))
                    continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    found.append(int(pid))
                    break
        except OSError:
            continue
    return sorted(set(found) - {os.getpid()})


def jobs(shm_dir: str) -> list[dict]:
    """This user's job directories in ``shm_dir``: job, path, bytes, nodes, newest
    iteration of the status files, and the pids using it."""
    out = []
    for job in paths.job_parents(shm_dir):
        parent = paths.job_parent(shm_dir, job)
        if paths.private_problem(parent) is not None:
            continue  # another user's (or not private): not ours to list or remove
        names = os.listdir(parent)
        if any(not re.fullmatch(r"node\d+(\.meta)?", n) for n in names):
            continue  # not a job's parent (another layout, or not REFT's)
        nodes = sorted(int(n[4:]) for n in names if n[4:].isdigit())
        its = [r.get("iteration") for r in status.read_job(shm_dir, job)]
        its = [i for i in its if isinstance(i, int)]
        out.append({"job": job, "path": parent, "bytes": size(parent), "nodes": nodes,
                    "iteration": max(its) if its else None, "pids": users(parent)})
    return out


def remove(shm_dir: str, job: str) -> str:
    """Remove a job's directory if it is this user's and no process uses it; the line
    that says what was done."""
    parent = paths.job_parent(shm_dir, job)
    why = paths.private_problem(parent)
    if why is not None:
        return f"{parent} {why}: left alone"
    pids = users(parent)
    if pids:
        return f"{parent}: in use by pid(s) {pids} (a running job): left alone"
    nbytes = size(parent)
    shutil.rmtree(parent)
    return f"removed {parent} ({nbytes / 2**20:.1f} MiB of host memory)"
