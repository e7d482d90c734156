"""Save-on-failure: one small process per node that outlives the node's workers.

Started by the node's first rank (``spawn``) in its own session, so neither the death of
a worker nor torchrun's SIGTERM/SIGKILL of the worker group reaches it. It polls the
node's worker pids; when one dies (crash, or SIGTERM from a preempted agent):

1. the node's status becomes UNHEALTHY (its memory is intact), or OFFLINE when the
   node's shared-memory directory is gone (a lost node: nothing left to save);
2. it waits for the node's other workers to go too (torchrun stops them at once), so the
   snapshots are quiescent while they are copied;
3. it copies every complete snapshot slot of the node's ranks (manifest present) and the
   commit pointers to ``--reft-flush-dir``: the manifest is removed first and renamed into
   place after the fsynced data, so a flush cut short never pairs a manifest with torn
   bytes (and REFT-load verifies the checksums anyway); a slot whose manifest changed
   while its data was copied (a restarted worker already writing its next snapshot) is
   left out. Both slots are kept because the newest iteration every rank of the job
   holds may be the older one. A marker ``rank<r>.flushing`` per rank of the node is
   written before the first file and removed after the last: a flush cut short (the
   watcher killed, the node lost mid-flush) leaves it, and REFT-load never imports that
   rank's flushed files (reft_ext/load/flushed.py), old or new. The flush directory is
   created 0700; one owned by another user or writable by group or others is refused
   (one line naming it, nothing written there: whoever else can write there could
   redirect the copies through symbolic links or forge snapshots the next start loads),
   and every file goes through a fresh O_EXCL|O_NOFOLLOW temporary.

With ``--reft-hang-timeout`` it also reads the ranks' heartbeats (reft_ext/cluster/heartbeat.py):
a rank silent past its limit is named in one ``[REFT] hang: ...`` line and in the node's
status, and SIGKILLed (which works on a stopped process too); from there it is a worker
death like any other (steps 1-3), with the node's memory intact.

Under the in-process supervisor (``--adopt``) the watcher stays for the job: a rank's
death makes the node UNHEALTHY, and instead of steps 2-3 the watcher waits for the
restarted generation's ranks, which the node's first rank hands over through
``watch.json`` in the side directory (status.adopt_watcher), and watches them. Only when
every rank of the node has been gone for ADOPT_GRACE_S with no hand-over does it resign
and flush. (Before, every restart killed each node's watcher and started another: a
Python start per node beside the first iteration after the recovery.)

When training ends normally the ranks mark the node FINISHED and the watcher just exits.
Plain Python (no torch): it starts in milliseconds and costs one poll per 0.1 s.

Tests: ``REFT_WATCHER_FAULT=flush:NODE[:ATTEMPT][,...]`` in the workers' environment makes
node NODE's watcher of attempt ATTEMPT (default 0; counted as ``--inject-fault`` counts
it) SIGKILL itself halfway through its flush (a ``[FAULT]`` line first).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from reft_ext.cluster import heartbeat
from reft_ext.cluster import status
from reft_ext.store import paths
from reft_ext.store.atomic import tmp_name, write_atomic
from reft_ext.report.events import emit as reft_emit

POLL_S = 0.1
QUIESCE_S = 20.0  # torchrun stops the other workers within its own 30 s grace
ADOPT_GRACE_S = 5.0  # --adopt: how long a node with no rank left waits for the next generation
FAULT_ENV = "REFT_WATCHER_FAULT"
FLUSHING = ".flushing"  # rank<r>.flushing in the flush dir: that rank's flush incomplete


def fault_spec(node: int, attempt: int = 0) -> str:
    """The :data:`FAULT_ENV` entry that kills node ``node``'s watcher of attempt
    ``attempt`` halfway through its flush (join several with commas)."""
    return f"flush:{node}:{attempt}"


def _attempt() -> int:
    """The attempt of the workers this watcher watches (reft_ext/testing/
    fault_specs.py counts the same way; the watcher inherits their environment)."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) +
            int(os.environ.get("REFT_NODE_GENERATION", "0")))


def flush_fault(node: int) -> bool:
    """Is this node's watcher asked (:data:`FAULT_ENV`) to die halfway through its flush?"""
    for part in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        bits = part.strip().split(":")
        if bits[0] != "flush" or len(bits) not in (2, 3) or \
                not all(b.isdigit() for b in bits[1:]):
            continue  # not a flush fault this watcher understands
        if int(bits[1]) == node and (int(bits[2]) if len(bits) == 3 else 0) == _attempt():
            return True
    return False


def alive(pid: int) -> bool:
    """A zombie (dead, not yet reaped by the agent) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _copy_durable(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` through a fresh temporary (an unpredictable name, created
    O_EXCL|O_NOFOLLOW, 0600: nothing planted there is ever written through), fsynced,
    then renamed into place."""
    tmp = tmp_name(dst)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with open(src, "rb") as fi, open(fd, "wb") as fo:
            shutil.copyfileobj(fi, fo, 16 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class FlushDirError(PermissionError):
    """--reft-flush-dir is not this user's private directory: nothing is flushed there."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def check_flush_dir(flush_dir: str) -> None:
    """Create ``flush_dir`` (0700) or refuse (:class:`FlushDirError`, one line naming
    it) one owned by another user or writable by group or others: whoever else can
    write there could redirect the flush's files (symbolic links) or forge snapshots
    that the next start loads."""
    try:
        paths.ensure_private(flush_dir, "--reft-flush-dir",
                             "The snapshots are not flushed there (the node's host memory "
                             "still holds them); point --reft-flush-dir at a directory of "
                             "this user that only this user can write (chmod 700)",
                             fix_mode=False)
    except paths.PrivateDirError as exc:
        raise FlushDirError(exc.errno, exc.strerror) from None


def _unchanged(mpath: str, text: str) -> bool:
    """Is the slot's manifest still ``text``? A snapshot written into the slot deletes
    it before its first byte (reft_ext/store/slots.py ``begin``), so the same text after
    the data was copied means the data did not change meanwhile."""
    try:
        with open(mpath) as f:
            return f.read() == text
    except OSError:
        return False


def _die_halfway(node: int, flush_dir: str) -> None:
    """(tests, :data:`FAULT_ENV`) the watcher killed in the middle of its flush."""
    reft_emit("fault", f"watcher of node {node} (pid {os.getpid()}): SIGKILL halfway "
              f"through its flush to {flush_dir}", prefix="[FAULT]", phase="flush",
              node=node, pid=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def flush_node(node_dir: str, flush_dir: str, node: int | None = None) -> dict[int, list[int]]:
    """Copy the node's complete snapshot slots to flush_dir; rank -> flushed iterations.
    Each rank's ``.flushing`` marker stays in flush_dir until the last file is copied.
    ``node``: this node's number, for the test fault (:data:`FAULT_ENV`)."""
    check_flush_dir(flush_dir)
    die = node is not None and flush_fault(node)
    ranks = sorted({os.path.basename(p).split(".")[0] for p in
                    glob.glob(os.path.join(node_dir, "rank*.slot*.json")) +
                    glob.glob(os.path.join(node_dir, "rank*.committed"))})
    markers = [os.path.join(flush_dir, r + FLUSHING) for r in ranks]
    for m in markers:  # before anything of the rank is replaced
        write_atomic(m, "flush in progress (a watcher cut short leaves this file)\n",
                     durable=True)
    done: dict[int, list[int]] = {}
    mpaths = sorted(glob.glob(os.path.join(node_dir, "rank*.slot*.json")))
    for mpath in mpaths:
        name = os.path.basename(mpath)[:-len(".json")]
        try:
            with open(mpath) as f:
                text = f.read()
            manifest = json.loads(text)
            if os.path.getsize(os.path.join(node_dir, name + ".bin")) < manifest["nbytes"]:
                continue
        except (OSError, ValueError, KeyError):
            continue  # being rewritten or torn: not a complete slot
        try:
            os.unlink(os.path.join(flush_dir, name + ".json"))  # manifest last, as in shm
        except FileNotFoundError:
            pass
        _copy_durable(os.path.join(node_dir, name + ".bin"), os.path.join(flush_dir,
                                                                          name + ".bin"))
        if not _unchanged(mpath, text):
            continue  # rewritten while copied (a restarted worker's next snapshot)
        if die and sum(map(len, done.values())) >= len(mpaths) // 2:
            # half the slots flushed, and this one's data but not its manifest
            _die_halfway(node, flush_dir)
        write_atomic(os.path.join(flush_dir, name + ".json"), text, durable=True)
        done.setdefault(int(manifest["rank"]), []).append(int(manifest["iteration"]))
    for c in glob.glob(os.path.join(node_dir, "rank*.committed")):
        try:
            _copy_durable(c, os.path.join(flush_dir, os.path.basename(c)))
        except OSError:
            pass
    for m in markers:  # the rank's flush is whole
        os.unlink(m)
    return done


def kill_hung(a, hung: list[dict]) -> str:
    """Report and SIGKILL the hung ranks; returns the cause for the node's status."""
    lines = [heartbeat.describe(h, a.node, a.hang_timeout) for h in hung]
    for h, line in zip(hung, lines):
        status.write(a.shm_dir, a.job, a.node, status.UNHEALTHY, detail=f"hang: {line}")
        reft_emit("hang", f"hang: {line}; SIGKILL so that torchrun restarts the workers",
                  rank=h["rank"], pid=h["pid"], node=a.node, silent_s=round(h["silent"], 1),
                  state=heartbeat.STATE_NAMES[h["state"]], iteration=h["iteration"],
                  limit_s=h["limit"], timeout_s=a.hang_timeout,
                  starved_s=round(h.get("starved", 0.0), 1),
                  process=heartbeat.process_state(h["pid"]))
        try:
            os.kill(h["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5.0  # until /proc shows it dead (the agent reaps it)
    while any(alive(h["pid"]) for h in hung) and time.time() < deadline:
        time.sleep(0.01)
    return "hang: " + "; ".join(lines)


def _await_adoption(a, w, node_dir: str, cause: str) -> bool:
    """--adopt, a rank died (or was killed as hung) and its node's memory is intact: the
    in-process supervisor restarts the generation, and its ranks hand themselves over.
    True once they have (watch again). False when every rank of the node has been gone
    for ADOPT_GRACE_S with no hand-over (the job is ending, or the node's ranks went to
    another node): the watcher resigns (its pid file goes, so a later generation starts
    a watcher of its own) and flushes as before."""
    rec = status.read(a.shm_dir, a.job, a.node) or {}
    if rec.get("state") == status.FINISHED or not os.path.isdir(node_dir):
        return False
    dead = [p for p in w.pids if not alive(p)]
    status.write(a.shm_dir, a.job, a.node, status.UNHEALTHY,
                 detail=f"{cause or f'worker(s) {dead} died'}; node memory intact")
    deadline = None
    while True:
        if w.adopted():
            return True
        if any(alive(p) for p in w.pids):
            deadline = None
        elif deadline is None:
            deadline = time.monotonic() + ADOPT_GRACE_S
        elif time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    # what waits for the node's flush (status.wait_watchers) still finds this process
    status.write_watcher_pid(a.shm_dir, a.job, a.node, os.getpid(), status.FLUSHING)
    status.remove_side_files(a.shm_dir, a.job, a.node, [status.WATCHER_PID])
    if w.adopted():  # handed over in the instant before: watch on, under its pid again
        status.write_watcher_pid(a.shm_dir, a.job, a.node, os.getpid())
        status.remove_side_files(a.shm_dir, a.job, a.node, [status.FLUSHING])
        return True
    return False


class _Watched:
    """The node's ranks being watched. ``--adopt`` (under the in-process supervisor): an
    in-process restart hands the next generation's ranks over through the side
    directory's watch list (status.adopt_watcher) instead of starting another watcher."""

    def __init__(self, a):
        self.a = a
        self.node_dir = paths.node_dir(a.shm_dir, a.job, a.node)
        self.generation = -1
        self.set([int(p) for p in a.pids.split(",")],
                 [int(r) for r in a.ranks.split(",")] if a.ranks else [])
        self._seen = None  # the watch list's (mtime, size) last read

    def set(self, pids: list[int], ranks: list[int]) -> None:
        self.pids = pids
        self.hangs = heartbeat.HangMonitor(self.node_dir, ranks, pids, self.a.hang_timeout) \
            if self.a.hang_timeout > 0 and ranks else None

    def adopted(self) -> bool:
        """A newer generation's ranks were handed over (now watched)."""
        if not self.a.adopt:
            return False
        try:  # one stat per poll; read only when it changed
            st = os.stat(os.path.join(paths.side_dir(self.a.shm_dir, self.a.job, self.a.node),
                                      status.WATCH))
        except OSError:
            return False
        if (st.st_mtime_ns, st.st_size) == self._seen:
            return False
        self._seen = (st.st_mtime_ns, st.st_size)
        rec = status.read_watch_list(self.a.shm_dir, self.a.job, self.a.node)
        if rec is None or int(rec["generation"]) <= self.generation:
            return False
        self.generation = int(rec["generation"])
        self.set([int(p) for p in rec["pids"]], [int(r) for r in rec["ranks"]])
        return True


def watch(a) -> int:
    w = _Watched(a)
    node_dir = w.node_dir
    while True:
        cause = ""
        while all(alive(p) for p in w.pids):
            hung = w.hangs.check() if w.hangs is not None else []
            if hung:
                cause = kill_hung(a, hung)
                break
            w.adopted()
            time.sleep(POLL_S)
        if not (a.adopt and _await_adoption(a, w, node_dir, cause)):
            break
    pids = w.pids
    rec = status.read(a.shm_dir, a.job, a.node) or {}
    if rec.get("state") == status.FINISHED:
        if not os.path.isdir(node_dir):  # snapshots removed at the end: nothing to show
            status.remove_side_files(a.shm_dir, a.job, a.node,
                                     [status.STATUS, status.WATCHER_PID, status.WATCH])
        return 0
    dead = [p for p in pids if not alive(p)]
    if not os.path.isdir(node_dir):
        status.write(a.shm_dir, a.job, a.node, status.OFFLINE,
                     detail=f"worker(s) {dead} died and the node's memory is gone")
        return 0
    died = cause or f"worker(s) {dead} died"
    status.write(a.shm_dir, a.job, a.node, status.UNHEALTHY,
                 detail=f"{died}; node memory intact")
    deadline = time.time() + QUIESCE_S
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(POLL_S)
    if not a.flush_dir:
        return 0
    t0 = time.time()
    try:
        done = flush_node(node_dir, a.flush_dir, a.node)
    except OSError as exc:  # checked writable at start-up; full or gone since: say so
        msg = (f"node {a.node}: flush of the snapshots to --reft-flush-dir {a.flush_dir} "
               f"failed: {exc}; the node's host memory still holds them until it is wiped")
        status.write(a.shm_dir, a.job, a.node, status.UNHEALTHY,
                     detail=f"{cause}; {msg}" if cause else msg)
        reft_emit("flush_failed", msg, node=a.node, flush_dir=a.flush_dir, error=str(exc))
        return 1
    its = sorted({i for v in done.values() for i in v})
    msg = (f"flushed node {a.node}'s snapshots (ranks {sorted(done)}, iterations {its}) to "
           f"{a.flush_dir} in {time.time() - t0:.2f} s")
    status.write(a.shm_dir, a.job, a.node, status.UNHEALTHY,
                 detail=f"{cause}; {msg}" if cause else msg)
    reft_emit("flushed", msg, node=a.node, ranks=sorted(done), iterations=its,
              flush_dir=a.flush_dir)
    return 0


def spawn(shm_dir: str, job: str, node: int, pids: list[int], flush_dir: str,
          ranks: list[int] | None = None, hang_timeout: float = 0.0,
          adopt: bool = False) -> int:
    """Start the node's watcher in its own session; returns its pid. ``ranks`` (the
    global ranks of ``pids``, same order) and ``hang_timeout`` > 0 turn on hang detection;
    ``adopt``: in-process restarts hand it their ranks (status.adopt_watcher)."""
    paths.ensure_side_dir(shm_dir, job, node)  # refused before anything starts
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    p = subprocess.Popen(
        [sys.executable, "-m", "reft_ext.cluster.watcher", "--shm-dir", shm_dir, "--job", job,
         "--node", str(node), "--pids", ",".join(map(str, pids)), "--flush-dir", flush_dir,
         "--ranks", ",".join(map(str, ranks or [])), "--hang-timeout", str(hang_timeout),
         *(["--adopt"] if adopt else [])],
        env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        status.write_watcher_pid(shm_dir, job, node, p.pid)
    except OSError:  # the side directory refused (another user's): no orphan watcher
        p.kill()
        p.wait()
        raise
    return p.pid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="REFT node watcher (save-on-failure, hang detection)")
    p.add_argument("--shm-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--pids", required=True)
    p.add_argument("--flush-dir", default="")
    p.add_argument("--ranks", default="", help="global ranks of --pids (hang detection)")
    p.add_argument("--hang-timeout", type=float, default=0.0,
                   help="seconds without a heartbeat before a rank counts as hung (0 = off)")
    p.add_argument("--adopt", action="store_true",
                   help="in-process restarts hand this watcher their ranks (watch.json in "
                        "the side directory); it flushes only once all its ranks are gone")
    a = p.parse_args(argv)
    try:
        return watch(a)
    finally:  # a resigned watcher's flush is over (status.wait_watchers)
        status.remove_flushing(a.shm_dir, a.job, a.node, os.getpid())


if __name__ == "__main__":
    sys.exit(main())
