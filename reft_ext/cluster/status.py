"""REFT's state signals, one small status file per node (failure domain).

    <shm>/reft-<job>/node<n>.meta/status.json   {"node", "ranks", "state", "iteration", ...}
    <shm>/reft-<job>/node<n>.meta/watcher.pid
    <shm>/reft-<job>/node<n>.meta/watch.json    {"generation", "pids", "ranks"}

In the node's side directory (reft_ext/store/paths.py), next to its shared-memory
directory, not inside it: a node whose memory is wiped still gets its OFFLINE written by
whoever saw it go (the launcher, the node's watcher). The side directory is private
(0700, this user's; another user's is refused when written, ignored when read) and a file
in it is read only if it is this user's own: nothing another user planted in the shared
/dev/shm (a FINISHED status that would stop a flush, a pid file) is ever trusted.
States (REFT's workflow): HEALTHY (training started), SNAP (a snapshot is being copied),
COMPLETED (the node's shards of ``iteration`` are complete and committed), UNHEALTHY (a
worker died, the node's memory is intact), OFFLINE (the node is gone), FINISHED (training
ended normally; the watcher must not flush). Writes are atomic (tmp + rename, 0600) and not
fsynced: a tmpfs file written at most twice per snapshot by one rank per node.
Plain Python (no torch), so the watcher and ``tools/reft_status.py`` start fast.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

from reft_ext.store import paths
from reft_ext.store.atomic import write_atomic

HEALTHY, SNAP, COMPLETED = "HEALTHY", "SNAP", "COMPLETED"
UNHEALTHY, OFFLINE, FINISHED = "UNHEALTHY", "OFFLINE", "FINISHED"
STATES = (HEALTHY, SNAP, COMPLETED, UNHEALTHY, OFFLINE, FINISHED)


STATUS, WATCHER_PID = "status.json", "watcher.pid"  # in the node's side directory
WATCH = "watch.json"  # an in-process restart's ranks, for the node's watcher to adopt
# a watcher that resigned (no pid file: nothing adopts it) and is still flushing
FLUSHING = "watcher.flushing"


def path(shm_dir: str, job: str, node: int) -> str:
    return paths.node_file(shm_dir, job, node, STATUS)


def watcher_pid_path(shm_dir: str, job: str, node: int) -> str:
    return paths.node_file(shm_dir, job, node, WATCHER_PID)


def read(shm_dir: str, job: str, node: int) -> dict | None:
    text = paths.read_private(path(shm_dir, job, node))
    try:
        rec = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _write(shm_dir: str, job: str, node: int, rec: dict, dir_checked: bool = False) -> None:
    if not dir_checked:
        paths.ensure_side_dir(shm_dir, job, node)
    # per writer: the launcher and a rank may race
    write_atomic(path(shm_dir, job, node), json.dumps(rec), per_writer=True)


def write(shm_dir: str, job: str, node: int, state: str, iteration: int | None = None,
          ranks: list[int] | None = None, detail: str = "") -> dict:
    """Set the node's state; fields not given keep their last value (iteration = last
    COMPLETED iteration, ranks = the node's global ranks)."""
    if state not in STATES:
        raise ValueError(f"unknown REFT node state {state!r}")
    old = read(shm_dir, job, node) or {}
    rec = {"node": node, "ranks": ranks if ranks is not None else old.get("ranks", []),
           "state": state,
           "iteration": iteration if iteration is not None else old.get("iteration"),
           "updated": time.time(), "detail": detail, "pid": os.getpid()}
    _write(shm_dir, job, node, rec)
    return rec


def read_job(shm_dir: str, job: str) -> list[dict]:
    """Every node's status of a job, by node index."""
    out = []
    for p in glob.glob(paths.side_glob(shm_dir, job, STATUS)):
        node = paths.side_node_of(p, job)
        if node is not None:
            rec = read(shm_dir, job, node)
            if rec is not None:
                out.append(rec)
    return sorted(out, key=lambda r: r["node"])


def jobs(shm_dir: str) -> list[str]:
    names = glob.glob(os.path.join(shm_dir, f"{paths.PREFIX}*", f"node*{paths.SIDE}", STATUS))
    return sorted({paths.job_of(os.path.dirname(n), paths.SIDE) for n in names} - {None})


# ---- the node's watcher process (reft_ext/cluster/watcher.py) -----------------------------
def _read_pid(p: str) -> int | None:
    try:
        return int((paths.read_private(p) or "").strip())
    except ValueError:
        return None


def write_watcher_pid(shm_dir: str, job: str, node: int, pid: int,
                      name: str = WATCHER_PID) -> str:
    paths.ensure_side_dir(shm_dir, job, node)
    p = paths.node_file(shm_dir, job, node, name)
    write_atomic(p, str(pid), per_writer=True)
    return p


def remove_flushing(shm_dir: str, job: str, node: int, pid: int) -> None:
    """The resigned watcher ``pid`` has flushed: its FLUSHING file goes (not another's)."""
    if _read_pid(paths.node_file(shm_dir, job, node, FLUSHING)) == pid:
        remove_side_files(shm_dir, job, node, [FLUSHING])


def watcher_pid(shm_dir: str, job: str, node: int) -> int | None:
    pid = _read_pid(watcher_pid_path(shm_dir, job, node))
    if pid is None or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
        return pid
    except OSError:
        return None


def kill_watcher(shm_dir: str, job: str, node: int) -> None:
    """A lost node's processes die with it, its watcher included."""
    pid = watcher_pid(shm_dir, job, node)
    if pid is not None and _is_watcher(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    remove_side_files(shm_dir, job, node, [WATCHER_PID])


def write_watch_list(shm_dir: str, job: str, node: int, generation: int, pids: list[int],
                     ranks: list[int]) -> None:
    """The node's ranks of in-process generation ``generation``, for its watcher."""
    paths.ensure_side_dir(shm_dir, job, node)
    write_atomic(os.path.join(paths.side_dir(shm_dir, job, node), WATCH),
                 json.dumps({"generation": generation, "pids": pids, "ranks": ranks}),
                 per_writer=True)


def read_watch_list(shm_dir: str, job: str, node: int) -> dict | None:
    text = paths.read_private(os.path.join(paths.side_dir(shm_dir, job, node), WATCH))
    try:
        rec = json.loads(text) if text else None
        return rec if isinstance(rec, dict) and {"generation", "pids", "ranks"} <= set(rec) \
            else None
    except ValueError:
        return None


def adopt_watcher(shm_dir: str, job: str, node: int, generation: int, pids: list[int],
                  ranks: list[int]) -> bool:
    """In-process restart: hand the node's running watcher (one started with --adopt)
    the ranks of the new generation instead of killing it and starting another (a
    Python start per node, competing with the first iteration after the recovery).
    False where there is none to hand them to: the caller starts one. A watcher that
    adopts only ever flushes once all of its ranks are dead, so with the caller (one of
    them) alive it cannot be past adopting."""
    pid = watcher_pid(shm_dir, job, node)
    if pid is None or not _is_watcher(pid, b"--adopt"):
        return False
    write_watch_list(shm_dir, job, node, generation, pids, ranks)
    return True


def remove_side_files(shm_dir: str, job: str, node: int, names: list[str]) -> None:
    """Remove these files of the node's side directory, and the directory once empty;
    nothing in a side directory that is not this user's private one."""
    d = paths.side_dir(shm_dir, job, node)
    if paths.private_problem(d) is not None:
        return
    for n in names:
        try:
            os.unlink(os.path.join(d, n))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(d)
        paths.remove_parent(shm_dir, job)  # the job's parent, once nothing is left in it
    except OSError:
        pass  # other files left (a handover note, the status): it stays


def _is_watcher(pid: int, flag: bytes = b"") -> bool:
    """Guard against pid reuse: only ever signal our own watcher module (``flag``: one
    started with it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"reft_ext.cluster.watcher" in argv and (not flag or flag in argv)


def wait_watchers(shm_dir: str, job: str, timeout: float) -> bool:
    """Wait until no watcher of the job runs (they exit after flushing; one that
    resigned flushes under its FLUSHING file)."""
    deadline = time.time() + timeout
    patterns = [paths.side_glob(shm_dir, job, n) for n in (WATCHER_PID, FLUSHING)]
    while time.time() < deadline:
        alive = []
        for p in [f for pat in patterns for f in glob.glob(pat)]:
            pid = _read_pid(p)
            if pid is not None and pid > 0 and _is_watcher(pid):
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


class NodeSignals:
    """The ranks' side of the signals: the node's first rank writes for the whole node
    (one writer per file; the others are no-ops). Never lets a failed write stop
    training: the signals inform, the snapshots and their checksums decide."""

    def __init__(self, shm_dir: str, job: str, node: int, ranks: list[int], leader: bool,
                 min_interval_s: float = 0.0):
        self.shm_dir, self.job, self.node, self.ranks = shm_dir, job, node, ranks
        self.leader, self.iteration = leader, None
        # SNAP and COMPLETED follow each other every iteration: written at most once per
        # min_interval_s (a file replaced twice per iteration was ~0.2 ms of each, issue
        # 57; the status is for people and tools, the manifests decide recovery). Any
        # other state, and the first of a run, is written at once
        self.min_interval_s, self._last = min_interval_s, None
        self.path = path(shm_dir, job, node)
        # the side directory was checked private (once: a 0700 directory of this user
        # cannot be swapped by another; checked again if it has gone). Two signals per
        # snapshot each walked it from the root: ~0.5 ms of every iteration (issue 57)
        self._dir_ok = False

    def set(self, state: str, iteration: int | None = None, detail: str = "") -> None:
        if not self.leader:
            return
        if iteration is not None:
            self.iteration = iteration
        now = time.monotonic()
        if state in (SNAP, COMPLETED) and self._last is not None and \
                self._last[0] in (SNAP, COMPLETED) and now - self._last[1] < self.min_interval_s:
            return
        self._last = (state, now)
        rec = {"node": self.node, "ranks": self.ranks, "state": state,
               "iteration": self.iteration, "updated": time.time(), "detail": detail,
               "pid": os.getpid()}
        try:
            if self._dir_ok:
                try:
                    _write(self.shm_dir, self.job, self.node, rec, dir_checked=True)
                    return
                except FileNotFoundError:  # the directory went (the job's cleanup)
                    self._dir_ok = False
            _write(self.shm_dir, self.job, self.node, rec)
            self._dir_ok = True
        except OSError:
            pass
