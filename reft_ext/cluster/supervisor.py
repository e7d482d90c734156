"""The in-process supervisor: starts every rank itself, keeps warm spares, and turns a
failure into a new generation instead of a restart of every process.

torchrun cannot do this: its agent stops every local worker when one fails, and the c10d
rendezvous makes every other agent restart too. Here one supervisor per job (a host of
its own on a cluster, as an etcd is; ``tools/launch_nodes.py --restart in-process`` on
one host) owns a TCPStore and the rank processes (reft_ext/cluster/spare.py):

* a rank that exits non-zero (crash, SIGKILL, its node lost), or an ``abort/<g>`` that a
  rank set (a collective failed), ends generation g: the supervisor sets ``abort/<g>``
  (every rank's abort watcher closes its communicators: reft_ext/cluster/inprocess.py);
* it waits until every rank is either dead or ``ready/<g>/<rank>`` (torn down, waiting),
  at most ``abort_timeout`` s; a rank that is neither by then (frozen) is SIGKILLed;
* each dead rank's place goes to a warm spare (imports done) or a new worker, which
  joins generation g + 1 directly; then ``gen = g + 1`` is published and the survivors
  rendezvous with the replacements in the same processes they had;
* the spare pool is refilled once every rank has finished an iteration in the new
  generation (``trained/<g>/<rank>``): on a shared host a spare's imports would
  otherwise take cores from the very recovery it shortens.

The store listens on loopback only (:func:`listen`), and what steers the job in it is
signed with the job's secret (reft_ext/cluster/inprocess.py ``sign``), which the
supervisor makes and hands its workers in their environment: a local process that
connects to the store can neither abort the job nor give a spare a rank, let alone an
environment (a spare is sent a rank and a generation, nothing else).

``history`` records every generation change (who died, the times of each step), what
benchmarks/bench_recovery.py splits downtime with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from reft_ext.cluster.inprocess import (ENV_SECRET, key, new_secret, read_signed,
                                        set_first, sign)
from reft_ext.report.threads import join_or_warn

# what a warm spare imports while it waits (a cold worker imports the same on its own)
DEFAULT_PRELOAD = ("torch,megatron.core.parallel_state,megatron.core.models.gpt,"
                   "megatron.core.optimizer,megatron.training.training,reft_ext.session")


@dataclass
class SupervisorConfig:
    world_size: int
    ranks_per_node: int
    script: str
    script_args: list[str]
    job_id: str
    log_dir: str
    spares: int = 0               # warm workers kept ready beside the job's ranks
    max_restarts: int = 3         # generations after the first (torchrun's meaning)
    abort_timeout: float = 30.0   # s a rank may take to stop after an abort (then killed)
    preload: str = DEFAULT_PRELOAD
    env: dict = field(default_factory=dict)
    cwd: str = ""

    def __post_init__(self):
        if self.world_size < 1 or self.ranks_per_node < 1 or \
                self.world_size % self.ranks_per_node:
            raise ValueError(f"--nproc-per-node {self.ranks_per_node} must divide the "
                             f"world size {self.world_size}")
        if self.spares < 0:
            raise ValueError(f"--spares: must be >= 0, got {self.spares}")
        if self.abort_timeout <= 0:
            raise ValueError(f"--abort-timeout: must be > 0, got {self.abort_timeout}")


def listen(host: str = "127.0.0.1", port: int = 0, **kwargs):
    """A TCPStore server listening on ``host`` only. ``TCPStore(host, port,
    is_master=True)`` ignores ``host`` and listens on every interface (the libuv
    server binds ``::``/``0.0.0.0``; torch 2.13), so the socket is bound here and handed
    over (``master_listen_fd``): the store takes the descriptor over."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        sock.bind((host, port))
        sock.listen(4096)
        port = sock.getsockname()[1]
        store = TCPStore(host, port, is_master=True, master_listen_fd=sock.fileno(),
                         **kwargs)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


class _Worker:
    def __init__(self, wid: int, proc: subprocess.Popen, log: str, started: float):
        self.wid, self.proc, self.log, self.started = wid, proc, log, started
        self.rank: int | None = None


class Supervisor:
    """start(), kill_rank(r), wait(), close(); ``logs[rank]`` and ``history``."""

    def __init__(self, cfg: SupervisorConfig):
        self.cfg = cfg
        self.store = None
        self.port = 0
        self.gen = 0
        self.ranks: dict[int, _Worker] = {}   # rank -> its current worker
        self.spares: list[_Worker] = []
        self.logs: dict[int, list[str]] = {r: [] for r in range(cfg.world_size)}
        self.history: list[dict] = []
        self.returncode: int | None = None
        self.failure = ""
        self._next_wid = 0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._secret_hex = new_secret()  # the job's HMAC key: environment only, never stored
        self.secret = bytes.fromhex(self._secret_hex)
        os.makedirs(cfg.log_dir, exist_ok=True)

    # ---- workers ----------------------------------------------------------------
    def _spawn(self) -> _Worker:
        wid, self._next_wid = self._next_wid, self._next_wid + 1
        log = os.path.join(self.cfg.log_dir, f"worker{wid}.log")
        cmd = [sys.executable, "-m", "reft_ext.cluster.spare", "--store",
               f"127.0.0.1:{self.port}", "--id", str(wid), "--preload", self.cfg.preload,
               "--world-size", str(self.cfg.world_size),
               "--ranks-per-node", str(self.cfg.ranks_per_node), "--job-id", self.cfg.job_id,
               "--", self.cfg.script, *self.cfg.script_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.cfg.env)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        env[ENV_SECRET] = self._secret_hex
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.cfg.cwd or None, start_new_session=True)
        return _Worker(wid, proc, log, time.time())

    def _assign(self, w: _Worker, rank: int) -> None:
        """Give worker ``w`` a rank of the current generation: a signed (rank,
        generation), from which the worker makes the rank's environment itself
        (reft_ext/cluster/spare.py rank_env)."""
        w.rank = rank
        self.ranks[rank] = w
        self.logs[rank].append(w.log)
        k = key("assign", w.wid)
        self.store.set(k, sign(self.secret, k, json.dumps({"rank": rank, "gen": self.gen}),
                               self.gen))

    def _signed(self, k: str, gen: int) -> bool:
        """``k`` holds a value signed with the job's secret for generation ``gen``."""
        return read_signed(self.store, self.secret, k, gen) is not None

    def _publish(self) -> None:
        k = key("gen")
        self.store.set(k, sign(self.secret, k, str(self.gen), self.gen))

    def _take_worker(self) -> _Worker:
        """A warm spare if one is left, else a new one. The pool is refilled once the
        new generation is training again (:meth:`_refill`), not now: a spare's imports
        would take cores from the recovery it is meant to shorten."""
        return self.spares.pop(0) if self.spares else self._spawn()

    def _refill(self) -> None:
        """Top the spare pool up when every rank of the current generation has finished
        an iteration in it (``trained/<g>/<rank>``)."""
        if len(self.spares) >= self.cfg.spares or not all(
                self._signed(key("trained", self.gen, r), self.gen) for r in self.ranks):
            return
        while len(self.spares) < self.cfg.spares:
            self.spares.append(self._spawn())

    # ---- life cycle -------------------------------------------------------------
    def start(self) -> "Supervisor":
        self.store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
        self.port = self.store.port
        self._publish()
        for r in range(self.cfg.world_size):
            self._assign(self._spawn(), r)
        while len(self.spares) < self.cfg.spares:
            self.spares.append(self._spawn())
        self._thread = threading.Thread(target=self._run, name="reft-supervisor",
                                        daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    codes = {r: w.proc.poll() for r, w in self.ranks.items()}
                    dead = sorted(r for r, c in codes.items() if c not in (None, 0))
                    if all(c is not None for c in codes.values()) and \
                            (not dead or 0 in codes.values()):
                        # every rank ended; once one has finished training the job is
                        # over, and a rank failing in its shutdown does not rerun it
                        self.returncode = max(codes.values())
                        if dead:
                            self.failure = f"rank(s) {dead} failed after training ended"
                        return
                    if 0 in codes.values():
                        time.sleep(0.02)  # finishing: the others are saving, exiting
                        continue
                    asked = self._signed(key("abort", self.gen), self.gen)
                    if dead or asked:
                        if not self._new_generation(dead):
                            return
                        continue
                    self._refill()
                time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - reported, the job is stopped
            self.failure = f"supervisor: {type(exc).__name__}: {exc}"
            self.returncode = 1
            self._kill_all()

    def _new_generation(self, dead: list[int]) -> bool:
        """End generation g: abort, wait for survivors or deaths, replace, publish g+1."""
        g, t_detect = self.gen, time.time()
        reason = f"rank(s) {dead} exited" if dead else "a rank asked"
        set_first(self.store, self.secret, key("abort", g), f"supervisor: {reason}", g)
        deadline = time.time() + self.cfg.abort_timeout
        waiting = set(self.ranks)
        while True:
            for r in sorted(waiting):
                w = self.ranks[r]
                if w.proc.poll() is not None:
                    waiting.discard(r)
                elif self._signed(key("ready", g, r), g):
                    waiting.discard(r)
            if not waiting:
                break
            if time.time() > deadline:  # frozen: the same as dead
                for r in waiting:
                    _killpg(self.ranks[r].proc.pid, signal.SIGKILL)
                    self.ranks[r].proc.wait()
                break
            time.sleep(0.02)
        t_ready = time.time()
        dead = sorted(r for r, w in self.ranks.items() if w.proc.poll() is not None)
        if len(self.history) >= self.cfg.max_restarts:
            self.failure = (f"generation {g} failed ({reason}) and --max-restarts "
                            f"{self.cfg.max_restarts} are used up")
            self.returncode = 1
            self._kill_all()
            return False
        self.gen = g + 1
        warm = []
        for r in dead:
            w = self._take_worker()
            warm.append(self.store.check([key("warm", w.wid)]))
            self._assign(w, r)
        self._publish()
        self.history.append(dict(generation=self.gen, reason=reason, dead=dead,
                                 warm=warm, t_detect=t_detect, t_ready=t_ready,
                                 t_published=time.time()))
        return True

    # ---- faults from outside (tests, benchmarks) -----------------------------------
    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        with self._lock:
            _killpg(self.ranks[rank].proc.pid, sig)

    def max_restarts_reached(self) -> None:
        """No new generation from now on (preemption: the job is being stopped)."""
        self.cfg.max_restarts = len(self.history)

    def pids(self) -> dict[int, int]:
        return {r: w.proc.pid for r, w in self.ranks.items()}

    # ---- the end ----------------------------------------------------------------
    def wait(self, timeout: float) -> int:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.close()
                raise TimeoutError(f"the job is still running after {timeout} s")
        return self.returncode if self.returncode is not None else 1

    def _kill_all(self) -> None:
        for w in list(self.ranks.values()) + self.spares:
            if w.proc.poll() is None:
                _killpg(w.proc.pid, signal.SIGKILL)
                w.proc.wait()

    def close(self) -> None:
        """Nothing started here outlives the supervisor (ranks, spares)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            join_or_warn(self._thread, 5, "the in-process supervisor's monitor")
        self._kill_all()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
