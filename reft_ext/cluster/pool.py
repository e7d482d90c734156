"""Where the in-process supervisor's rank processes come from: a pool of workers.

The supervisor (reft_ext/cluster/supervisor.py) runs the generation protocol; a pool
starts, watches and kills the processes that hold the ranks. Two pools:

* :class:`LocalPool`: every worker a child of the supervisor on this host (Popen),
  what ``tools/launch_nodes.py --restart in-process`` uses;
* :class:`reft_ext.cluster.node_pool.NodePool`: workers started by one node agent per
  node (under srun), reached through the job's store: the multi-node path.

Both keep warm workers (imports done, waiting for an assignment: reft_ext/cluster/spare.py)
and hand out a warm one when a rank needs a process. What a pool decides is where a
rank's replacement runs: the local pool has one host; the node pool keeps a failure
domain whole (a crashed rank's replacement on its own node, a lost node's ranks all on
one spare node).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from reft_ext.cluster.inprocess import ENV_SECRET
from reft_ext import safe_dir


class Worker:
    """One process that holds, or may be given, a rank."""

    def __init__(self, wid: str, log: str = ""):
        self.wid, self.log = str(wid), log
        self.rank: int | None = None
        self.pid: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has ended (a lost node's workers: -SIGKILL), else None."""
        raise NotImplementedError

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise NotImplementedError

    def probe(self) -> None:
        """It is neither ready nor dead after an abort: find out soon (a node's loss)."""

    def cpu_seconds(self) -> float | None:
        """CPU time it has used (the start-up watch's progress), None where this host
        cannot read it (a node agent's worker on another host)."""
        return None

    def wait_dead(self, timeout: float) -> bool:
        """After :meth:`kill`: wait until it has ended; False if it has not in time."""
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                return False
            time.sleep(0.02)
        return True


class Pool:
    """start(store, port), take(rank), refill(), update(timeout), workers(), close()."""

    def start(self, store, host: str, port: int, secret_hex: str) -> None:
        raise NotImplementedError

    def take(self, rank: int) -> Worker:
        """A process for ``rank`` (warm if there is one where the rank must run)."""
        raise NotImplementedError

    def refill(self) -> None:
        """The job trains again: top up the warm workers."""

    def update(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for something to happen, and take it in."""
        time.sleep(timeout)

    def warm(self, w: Worker) -> bool:
        """Had ``w`` finished its imports when it was taken?"""
        raise NotImplementedError

    def swap_capacity(self) -> int:
        """How many nodes (slots) warm spares can take over now (a straggler swap)."""
        return 0

    def retire(self, slot: int) -> None:
        """``slot``'s node left for a spare (a straggler swap): its next workers come
        from elsewhere."""

    def workers(self) -> list[Worker]:
        raise NotImplementedError

    def describe(self) -> str:
        return ""

    def close(self) -> None:
        for w in self.workers():
            if w.poll() is None:
                w.kill(signal.SIGKILL)
                w.wait_dead(10)


def worker_command(store: str, wid: str, world_size: int, ranks_per_node: int, job_id: str,
                   preload: str, script: str, script_args: list[str]) -> list[str]:
    """The command line of a warm worker (reft_ext/cluster/spare.py)."""
    return [sys.executable, "-m", "reft_ext.cluster.spare", "--store", store, "--id", wid,
            "--preload", preload, "--world-size", str(world_size),
            "--ranks-per-node", str(ranks_per_node), "--job-id", job_id,
            "--", script, *script_args]


class _LocalWorker(Worker):
    def __init__(self, wid: str, proc: subprocess.Popen, log: str):
        super().__init__(wid, log)
        self.proc, self.pid = proc, proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def cpu_seconds(self) -> float | None:
        from reft_ext.cluster.startup_watch import cpu_seconds

        return cpu_seconds(self.pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_dead(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


class LocalPool(Pool):
    """Every worker a child process on this host; ``spares`` warm ones kept besides."""

    def __init__(self, cfg):
        self.cfg = cfg  # the SupervisorConfig
        self.spares: list[_LocalWorker] = []
        self.all: list[_LocalWorker] = []
        self._next = 0

    def start(self, store, host, port, secret_hex) -> None:
        self.store, self.addr, self.secret_hex = store, f"{host}:{port}", secret_hex

    def spawn(self) -> _LocalWorker:
        c = self.cfg
        wid, self._next = str(self._next), self._next + 1
        log = os.path.join(c.log_dir, f"worker{wid}.log")
        cmd = worker_command(self.addr, wid, c.world_size, c.ranks_per_node, c.job_id,
                             c.preload, c.script, c.script_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **c.env)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        env[ENV_SECRET] = self.secret_hex
        with open(safe_dir.open_file(log), "w") as f:  # never through a planted link
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=c.cwd or None, start_new_session=True)
        w = _LocalWorker(wid, proc, log)
        self.all.append(w)
        return w


    def take(self, rank: int) -> Worker:
        """A warm spare if one is left, else a new one. The pool is refilled once the
        new generation is training again (:meth:`refill`), not now: a spare's imports
        would take cores from the recovery it is meant to shorten."""
        return self.spares.pop(0) if self.spares else self.spawn()

    def refill(self) -> None:
        while len(self.spares) < self.cfg.spares:
            self.spares.append(self.spawn())

    def warm(self, w: Worker) -> bool:
        from reft_ext.cluster.inprocess import key

        return self.store.check([key("warm", w.wid)])

    def swap_capacity(self) -> int:
        """Whole nodes' worth of warm spares (one host: a swap takes any of them)."""
        return sum(self.warm(w) for w in self.spares) // self.cfg.ranks_per_node

    def workers(self) -> list[Worker]:
        return list(self.all)
