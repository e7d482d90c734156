"""The in-process supervisor: keeps the job's ranks in processes that survive a failure,
keeps warm spares, and turns a failure into a new generation instead of a restart of
every process.

torchrun cannot do this: its agent stops every local worker when one fails, and the c10d
rendezvous makes every other agent restart too. Here one supervisor per job owns a
TCPStore and runs the generation protocol; a *pool* (reft_ext/cluster/pool.py) owns the
rank processes: on one host the supervisor starts them itself (``LocalPool``,
``tools/launch_nodes.py --restart in-process``), across nodes one node agent per node
does (``NodePool``, reft_ext/cluster/node_pool.py; the supervisor is then the batch
step's coordinator, reft_ext/cluster/coordinator.py):

* a rank that exits non-zero (crash, SIGKILL, its node lost), or an ``abort/<g>`` that a
  rank set (a collective failed), ends generation g: the supervisor sets ``abort/<g>``
  and fills every rank's ``wake/<g>/<rank>`` (each rank's abort watcher, blocked on it,
  closes its communicators: reft_ext/cluster/inprocess.py);
* it waits until every rank is either dead or ``ready/<g>/<rank>`` (torn down, waiting),
  at most ``abort_timeout`` s; a rank that is neither by then (frozen) is asked for its
  threads' stacks (SIGUSR2: faulthandler, into its log), then SIGKILLed (by its node's
  agent on a cluster);
* each dead rank's place goes to a worker the pool picks (a warm one where it can: on
  the rank's own node, or a spare node for a lost one), which joins generation g + 1
  directly; then ``gen`` and ``gen/<g+1>`` are published and the survivors rendezvous
  with the replacements in the same processes they had;
* the warm workers are topped up once every rank has finished an iteration in the new
  generation (``trained/<g>/<rank>``): on a shared host a spare's imports would
  otherwise take cores from the very recovery it shortens.

Between events the supervisor blocks: on the local pool it polls its children (20 ms),
on the node pool it waits for the next ``ev/<n>`` key that anything it must act on posts.
The store listens on one address only (:func:`listen`: loopback on one host, the first
node's address on a cluster), and what steers the job in it is signed with the job's
secret (reft_ext/cluster/inprocess.py ``sign``), handed to the workers in their
environment: a process that connects to the store can neither abort the job nor give a
spare a rank, let alone an environment (a spare is sent a rank and a generation only).

``history`` records every generation change (who died, the times of each step), what
benchmarks/bench_recovery.py splits downtime with.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from reft_ext.cluster.inprocess import (STACKS_SIGNAL, key, new_secret, read_signed,
                                        set_first, sign, wake_ranks)
from reft_ext.cluster.job_stop import will_repeat
from reft_ext.cluster.pool import LocalPool, Pool, Worker
from reft_ext.cluster.startup_watch import StartupWatch, stopped
from reft_ext.cluster.straggler_swap import exits_are_swaps, publish_capacity
from reft_ext.report.threads import join_or_warn

# what a warm spare imports while it waits (a cold worker imports the same on its own),
# and MOD:FUNC, called with the script's arguments: what any rank needs (spare.py)
# the job's exit status when the scheduler's signal stopped it (128 + SIGTERM, a shell's
# code for a process that signal ended): every rank ended by it (or saved and exited 0),
# nothing failed on the way; tools/launch_nodes.py adds: and the snapshots were flushed
EXIT_PREEMPTED = 128 + signal.SIGTERM
STACKS_GRACE_S = 1.0  # a frozen rank's time to write its stacks before SIGKILL
DEFAULT_PRELOAD = ("torch,megatron.core.parallel_state,megatron.core.models.gpt,"
                   "megatron.core.optimizer,megatron.training.training,reft_ext.session,"
                   "megatron.training.warm:prepare")


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
    # the trainer's --reft-hang-timeout: a generation's start-up (or rejoin) that makes no
    # progress for twice this is aborted (startup_watch.py); 0 = not watched
    hang_timeout: float = 0.0
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
        if self.hang_timeout < 0:
            raise ValueError(f"--reft-hang-timeout: must be >= 0, got {self.hang_timeout}")


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


def failure_kind(dead: list[int], asked: str) -> str:
    """How a generation failed, without what differs between two failures of one kind
    (addresses, times, generation numbers): the same kind twice in a row is said."""
    if "start-up made no progress" in asked:
        return "its start-up stalled"
    if dead:
        return f"rank(s) {dead} exited"
    return re.sub(r"\d+", "N", asked.split(": ", 1)[-1])[:80]


class Supervisor:
    """start(), kill_rank(r), wait(), close(); ``logs[rank]`` and ``history``."""

    def __init__(self, cfg: SupervisorConfig, pool: Pool | None = None,
                 secret_hex: str | None = None):
        self.cfg = cfg
        self.pool = pool or LocalPool(cfg)
        self.store = None
        self.port = 0
        self.gen = 0
        self.ranks: dict[int, Worker] = {}   # rank -> its current worker
        self.logs: dict[int, list[str]] = {r: [] for r in range(cfg.world_size)}
        self.history: list[dict] = []
        self.returncode: int | None = None
        self.failure = ""
        self.preempted = 0  # the signal of a preemption (preempt): no generation after it
        self.watch = StartupWatch(cfg.hang_timeout)  # each generation's start-up
        self._capacity = -1  # the spare nodes last published (straggler swaps)
        self._trained_gen, self._trained = -1, set()  # ranks seen trained (_all_trained)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the job's HMAC key: environment only, never stored (a multi-node job's comes
        # from its batch script, which hands it to every node agent)
        self._secret_hex = secret_hex or new_secret()
        self.secret = bytes.fromhex(self._secret_hex)
        os.makedirs(cfg.log_dir, exist_ok=True)

    # ---- workers ----------------------------------------------------------------
    def _assign(self, w: Worker, rank: int) -> None:
        """Give worker ``w`` a rank of the current generation: a signed (rank,
        generation), from which the worker makes the rank's environment itself
        (reft_ext/cluster/spare.py rank_env)."""
        w.rank = rank
        self.ranks[rank] = w
        if w.log:
            self.logs[rank].append(w.log)
        k = key("assign", w.wid)
        self.store.set(k, sign(self.secret, k, json.dumps({"rank": rank, "gen": self.gen}),
                               self.gen))

    def _signed(self, k: str, gen: int) -> bool:
        """``k`` holds a value signed with the job's secret for generation ``gen``."""
        return read_signed(self.store, self.secret, k, gen) is not None

    def _publish(self) -> None:
        """``gen`` (what a rank reads) and ``gen/<g>`` (what a waiting rank blocks on)."""
        for k in (key("gen"), key("gen", self.gen)):
            self.store.set(k, sign(self.secret, k, str(self.gen), self.gen))

    def _all_trained(self, every: bool = False) -> bool:
        """Has every rank marked ``trained/<g>/<rank>``? A mark is read until seen once
        (not every rank's on each 20 ms pass: O(W) reads per pass); ``every``: look at
        all unseen ones (the start-up watch counts them), not up to the first missing."""
        if self._trained_gen != self.gen:
            self._trained_gen, self._trained = self.gen, set()
        for r in [r for r in self.ranks if r not in self._trained]:
            if self._signed(key("trained", self.gen, r), self.gen):
                self._trained.add(r)
            elif not every:
                return False
        return len(self._trained) == len(self.ranks)

    def _refill(self) -> None:
        """Top the warm workers up when every rank of the current generation has
        finished an iteration in it (``trained/<g>/<rank>``): on a shared host a spare's
        imports would otherwise take cores from the very recovery it shortens."""
        if self._all_trained():
            self.pool.refill()
        cap = self.pool.swap_capacity()
        if cap != self._capacity:  # what a straggler swap may take (straggler_swap.py)
            self._capacity = cap
            publish_capacity(self.store, self.secret, cap, self.gen)

    # ---- life cycle -------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0,
              on_listen=None) -> "Supervisor":
        self.store = listen(host, port, multi_tenant=True, wait_for_workers=False)
        self.port = self.store.port
        if on_listen is not None:
            on_listen()
        self.pool.start(self.store, host, self.port, self._secret_hex)
        self._publish()
        for r in range(self.cfg.world_size):
            self._assign(self.pool.take(r), r)
        self.watch.begin(self.gen)
        self.pool.refill()  # the warm spares, once every rank has its process
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
                    codes = {r: w.poll() for r, w in self.ranks.items()}
                    if self.preempted and self._preempted_end(codes):
                        return
                    dead = sorted(r for r, c in codes.items() if c not in (None, 0))
                    if all(c is not None for c in codes.values()) and \
                            (not dead or 0 in codes.values()):
                        # every rank ended; once one has finished training the job is
                        # over, and a rank failing in its shutdown does not rerun it
                        self.returncode = max(codes.values())
                        if dead:
                            self.failure = f"rank(s) {dead} failed after training ended"
                        return
                    repeat = will_repeat(codes[r] for r in dead)
                    if repeat is not None:  # a restart would fail the same way (job_stop.py)
                        self.failure = (f"rank(s) {dead} exited with {repeat}: a failure "
                                        f"every restart repeats (said above), not restarted")
                        self.returncode = repeat
                        self.pool.close()
                        return
                    if 0 not in codes.values():  # not finishing (the others saving)
                        asked = self._signed(key("abort", self.gen), self.gen)
                        if dead or asked:
                            if not self._new_generation(dead):
                                return
                            continue
                        self._refill()
                        self._watch_startup()
                self.pool.update(0.02)
        except Exception as exc:  # noqa: BLE001 - reported, the job is stopped
            self.failure = f"supervisor: {type(exc).__name__}: {exc}"
            self.returncode = 1
            self.pool.close()

    def _say(self, msg: str) -> None:
        say = getattr(self.pool, "say", None)
        if say is not None:
            say(msg)
        else:
            print(f"[supervisor] {msg}", flush=True)

    def _watch_startup(self) -> None:
        """Until every rank of the generation finished an iteration in it: a start-up
        (or rejoin) without progress for the watch's limit is aborted like a failure."""
        w = self.watch
        if not w.due():
            return
        ranks = sorted(self.ranks)
        self._all_trained(every=True)  # (reads only the marks not seen yet)
        marks = len(self._trained)
        silent = w.check([self.ranks[r].cpu_seconds() for r in ranks], marks, len(ranks))
        if silent is None:
            return
        w.finished = True
        reason = w.reason(silent)
        frozen = [r for r in ranks if stopped(self.ranks[r].pid if self.ranks[r].cpu_seconds()
                                               is not None else None)]
        if frozen:
            reason += f"; rank(s) {frozen} stopped (killed: a stopped process cannot abort)"
        self._say(f"{reason}: aborting it")
        set_first(self.store, self.secret, key("abort", self.gen), f"supervisor: {reason}",
                  self.gen)
        for r in frozen:
            self.ranks[r].kill(signal.SIGKILL)

    def _new_generation(self, dead: list[int]) -> bool:
        """End generation g: abort, wait for survivors or deaths, replace, publish g+1."""
        g, t_detect = self.gen, time.time()
        asked = read_signed(self.store, self.secret, key("abort", g), g) or ""
        reason = f"rank(s) {dead} exited" if dead else (asked or "a rank asked")
        if "start-up made no progress" in asked:  # the supervisor's own (startup_watch.py)
            reason = asked
        how = failure_kind(dead, asked)
        set_first(self.store, self.secret, key("abort", g), f"supervisor: {reason}", g)
        wake_ranks(self.store, g, self.ranks)
        deadline = time.time() + self.cfg.abort_timeout
        waiting = set(self.ranks)
        probe_at = time.time() + 0.2  # the live ones are ready by then, as a rule
        while True:
            for r in sorted(waiting):
                w = self.ranks[r]
                if w.poll() is not None or self._signed(key("ready", g, r), g):
                    waiting.discard(r)
            if not waiting:
                break
            if probe_at and time.time() > probe_at:  # is the silent ones' node there?
                for r in waiting:
                    self.ranks[r].probe()
                probe_at = 0
            if time.time() > deadline:  # frozen: the same as dead
                self._say(f"rank(s) {sorted(waiting)} did not stop within "
                          f"{self.cfg.abort_timeout:.0f} s of the abort: killing them "
                          f"(their threads' stacks are in their logs)")
                for r in waiting:
                    self.ranks[r].kill(STACKS_SIGNAL)
                until = time.time() + STACKS_GRACE_S
                while time.time() < until:
                    self.pool.update(0.05)
                for r in waiting:
                    self.ranks[r].kill(signal.SIGKILL)
                for r in waiting:
                    if not self.ranks[r].wait_dead(self.cfg.abort_timeout):
                        raise RuntimeError(f"rank {r} (worker {self.ranks[r].wid}) did not "
                                           f"end after SIGKILL")
                break
            self.pool.update(0.02)
        t_ready = time.time()
        codes = {r: w.poll() for r, w in self.ranks.items()}
        dead = sorted(r for r, c in codes.items() if c is not None)
        # a straggler's node left for a spare (--reft-replace-stragglers): a planned
        # generation, not a failure (straggler_swap.py)
        swapped = exits_are_swaps(codes, self.cfg.ranks_per_node)
        if swapped:
            reason = how = f"straggler swap: node(s) {swapped} swapped out for a spare"
            for slot in swapped:
                self.pool.retire(slot)
        failures = sum(1 for h in self.history if not h.get("planned"))
        if not swapped and failures >= self.cfg.max_restarts:
            self.failure = (f"generation {g} failed ({reason}) and --max-restarts "
                            f"{self.cfg.max_restarts} are used up")
            self.returncode = 1
            self.pool.close()
            return False
        self.gen = g + 1
        warm, where = [], []
        for r in dead:
            w = self.pool.take(r)
            warm.append(self.pool.warm(w))
            where.append(w.wid)
            self._assign(w, r)
        self._publish()
        # a failure that repeats (not a planned swap, nor one after a swap: a swap's
        # generation ends alike every time, by design)
        again = bool(self.history) and self.history[-1].get("how") == how and \
            not swapped and not self.history[-1].get("planned")
        self.history.append(dict(generation=self.gen, reason=reason, dead=dead,
                                 warm=warm, workers=where, t_detect=t_detect,
                                 t_ready=t_ready, t_published=time.time(), how=how,
                                 planned=bool(swapped)))
        self.watch.begin(self.gen)
        if again:
            self._say(f"generation {g} failed the same way as generation {g - 1} ({how})")
        if getattr(self.pool, "say", None) is not None:
            self._say(f"generation {self.gen}: rank(s) {dead} replaced by worker(s) {where} "
                      f"({sum(warm)} warm; {reason}); {self.pool.describe()}")
        return True

    # ---- faults from outside (tests, benchmarks) -----------------------------------
    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        with self._lock:
            self.ranks[rank].kill(sig)

    def preempt(self, sig: int = signal.SIGTERM) -> None:
        """The scheduler stops the job (its SIGTERM to the launcher): every rank gets
        ``sig`` (the trainer commits the snapshot in flight, the node watchers flush) and
        no generation follows; the job's code is then EXIT_PREEMPTED, or 1 where a rank
        failed on the way (``failure`` says which)."""
        with self._lock:
            self.preempted = int(sig)
            self.max_restarts_reached()
            for w in self.ranks.values():
                w.kill(sig)

    def _preempted_end(self, codes: dict) -> bool:
        """After :meth:`preempt`: once every rank ended, the job's code (True: ended)."""
        if any(c is None for c in codes.values()):
            return False
        sig = self.preempted
        bad = {r: c for r, c in codes.items() if c not in (0, -sig, 128 + sig)}
        self.returncode = 1 if bad else EXIT_PREEMPTED
        if bad:
            self.failure = (f"preempted (signal {sig}), but rank(s) {sorted(bad)} failed "
                            f"while stopping (exit codes {sorted(set(bad.values()))})")
        return True

    def max_restarts_reached(self) -> None:
        """No new generation from now on (preemption: the job is being stopped)."""
        self.cfg.max_restarts = len(self.history)

    def pids(self) -> dict[int, int]:
        return {r: w.pid for r, w in self.ranks.items()}

    # ---- the end ----------------------------------------------------------------
    def wait(self, timeout: float | None) -> int:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.close()
                raise TimeoutError(f"the job is still running after {timeout} s")
        return self.returncode if self.returncode is not None else 1

    def close(self) -> None:
        """Nothing started here outlives the supervisor (ranks, spares)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            join_or_warn(self._thread, 5, "the in-process supervisor's monitor")
        self.pool.close()
