"""One recovery of W simulated ranks through REFT's own control-plane code (the
in-process supervisor, its signed store protocol, the ranks' Generation and abort
watcher, the signed process-group store, REFT-load's inventory and plan): what
benchmarks/bench_control_plane.py runs once per (W, case) in a child process.

Ranks are threads; the supervisor is the real :class:`Supervisor` over a pool whose
workers are those threads (a "dead" worker is one whose exit code the bench set: its
thread stops). Store traffic is counted at the clients (ops and bytes, per phase).
Nothing here is a model of the protocol; the gloo connect is the store traffic gloo
makes (each peer's address read once per connection), replayed through the real signed
store: full mesh (every peer) or lazy (only the peers a rank exchanges with).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import resource
import threading
import time
from collections import defaultdict

import torch

from reft_ext.cluster import inprocess
from reft_ext.cluster.pool import Pool, Worker
from reft_ext.cluster import supervisor as supervisor_mod
from reft_ext.cluster.supervisor import Supervisor, SupervisorConfig

PHASES = ("detection", "abort", "new generation", "rendezvous", "process groups",
          "start-up agreement", "inventory", "planning", "exchange", "first iteration")
_tl = threading.local()
COUNTS: dict = defaultdict(lambda: [0, 0])  # phase -> [store ops, bytes]
_lock = threading.Lock()
CONNECTS = [0]


def _phase() -> str:
    return getattr(_tl, "phase", "abort")  # (the real abort watcher's thread)


def _size(v) -> int:
    return len(v) if isinstance(v, (bytes, str)) else 0


class Counting:
    """A store client whose every call is counted under the calling thread's phase."""

    def __init__(self, inner, phase: str | None = None):
        self._inner, self._fixed = inner, phase

    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            out = fn(*a, **k)
            n = sum(_size(x) for x in a) + _size(out)
            with _lock:
                c = COUNTS[self._fixed or _phase()]
                c[0] += len(a[0]) if name in ("multi_set", "multi_get") else 1
                c[1] += n
            return out
        return call


_SERVER = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from reft_ext.cluster.supervisor import listen
s = listen(multi_tenant=True, wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()  # until the bench closes it (or ends)
"""


def listen_apart(host: str = "127.0.0.1", port: int = 0, **kwargs):
    """The supervisor's TCPStore server (reft_ext.cluster.supervisor.listen, as it is) in
    a process of its own, as in a job (the supervisor's process, not the ranks'); the
    supervisor talks to it as a client. In this one process its accepted connections
    would count against the descriptor limit with the ranks' own: 4,096 ranks x 3
    clients x 2 ends is over this host's 20,000."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    SERVERS.append(proc)
    port = int(proc.stdout.readline())
    return torch.distributed.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=600))


SERVERS: list = []


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class SimWorker(Worker):
    def __init__(self, wid: str, run):
        super().__init__(wid)
        self.code = None
        self.wake = threading.Event()  # killed, or its rank's watcher saw the abort
        self.pid = os.getpid()
        self.thread = threading.Thread(target=run, args=(self,), daemon=True)

    def poll(self):
        return self.code

    def kill(self, sig=9):
        self.code = -int(sig)
        self.wake.set()

    def cpu_seconds(self):
        return None


class SimPool(Pool):
    """The supervisor's pool: every worker a thread running ``run(worker)``; a spare is
    warm (its imports done) by construction."""

    def __init__(self, run):
        self.run, self.all, self.n = run, [], 0
        self.refilled = threading.Event()

    def start(self, store, host, port, secret_hex):
        os.environ[inprocess.ENV_STORE] = f"{host}:{port}"
        os.environ[inprocess.ENV_SECRET] = secret_hex

    def take(self, rank):
        self.n += 1
        w = SimWorker(f"w{self.n}", self.run)
        self.all.append(w)
        w.thread.start()
        return w

    def warm(self, w):
        return True

    def refill(self):
        self.refilled.set()

    def workers(self):
        return self.all

    def close(self):
        for w in self.all:
            if w.code is None:
                w.code = 0


_raw_connect = inprocess._connect


def connect(timeout_s):
    """inprocess._connect, counted (the ranks' and their abort watchers' connections)."""
    with _lock:
        CONNECTS[0] += 1
    return Counting(_raw_connect(timeout_s))


class SimGeneration(inprocess.Generation):
    """The rank's real Generation; aborting its communicators is per process (its own
    groups' sockets: benchmarks/bench_teardown.py), not a store matter: here it only
    marks the abort."""

    def pg_store(self, timeout):
        """Generation.pg_store's store (a C++ PrefixStore needs the real client)."""
        from reft_ext.cluster.signed_store import SignedStore

        prefix = inprocess.key(f"g{self.gen}", "pg")
        if "pg" not in self._clients:
            with _lock:
                CONNECTS[0] += 1
            self._clients["pg"] = _raw_connect(timeout.total_seconds())
        store = torch.distributed.PrefixStore(prefix, self._clients["pg"])
        return SignedStore(store, self.secret, prefix)

    def abort_now(self, reason):
        with self._abort_lock:
            self.abort_reason = reason
            self.aborted.set()
            getattr(self, "wake", threading.Event()).set()


def lazy_peers(rank: int, world: int, group: list[int]) -> set[int]:
    """The peers a rank exchanges with during a recovery: its neighbours on the world's
    ring (the control group's ring all-gather and all-reduce) and its sharding group
    (REFT-load's slices); everything else is never connected with lazy gloo."""
    return ({(rank - 1) % world, (rank + 1) % world} | set(group)) - {rank}


def run_case(world: int, case: str, rpn: int, gloo: str, timeout: float = 600) -> dict:
    """One recovery; returns per-phase seconds, counts and whether every rank agreed."""
    from control_plane_state import layout, layout_groups, plan_over, synthetic_inventory

    tp, pp = layout(world)

    inprocess._connect = connect
    group_of = {r: g for g in layout_groups(world, tp, pp) for r in g}
    marks: dict = defaultdict(dict)   # phase -> rank -> end time
    result: dict = {}
    plan_box: dict = {}
    go_plan = threading.Event()

    def rank_main(w: SimWorker):
        _tl.phase = "start"
        sup_store = connect(timeout)  # (W connects at once: torch's client backs off)
        k = inprocess.key("assign", w.wid)
        sup_store.wait([k])
        a = json.loads(inprocess.read_signed(sup_store, inprocess.job_secret(), k))
        rank, gen = a["rank"], a["gen"]
        os.environ[inprocess.ENV_GENERATION] = str(gen)
        del sup_store
        g = SimGeneration(rank, world)
        g.gen = gen
        if gen == 0:
            g.pg_store(datetime.timedelta(seconds=timeout))  # its start-up's groups
            g.wake = w.wake
            g.client("watch", timeout)  # made here with the bench's patience: the watcher's
            g.watch()
            g.trained()
            w.wake.wait()  # the abort (its watcher) or a kill; no polling: W threads
            if w.code is not None:  # killed: the thread ends, nothing more said
                g._watcher._halt.set()
                return
            _tl.phase = "abort"
            g.next_generation(timeout, trained=1)
        else:
            _tl.phase = "rendezvous"
            while (g.published() or -1) < gen:
                g.store.wait([inprocess.key("gen", gen)])
            g.survivors_trained()
        marks["rendezvous"][rank] = time.time()
        _tl.phase = "process groups"
        pgs = Counting(g.pg_store(datetime.timedelta(seconds=timeout)))
        pgs.set(f"rank_{rank}", f"tcp://10.0.{rank // 256}.{rank % 256}:29{rank % 1000:03d}")
        peers = lazy_peers(rank, world, group_of[rank]) if gloo == "lazy" else \
            set(range(world)) - {rank}
        ring = {(rank - 1) % world, (rank + 1) % world} - {rank}
        for p in sorted(peers & ring):  # the control group's ring
            pgs.get(f"rank_{p}")
        marks["process groups"][rank] = time.time()
        # the rest: lazy, the sharding group's members, whose slices REFT-load's
        # exchange moves (its own, reported apart); full mesh, every other rank
        _tl.phase = "exchange" if gloo == "lazy" else "process groups"
        for p in sorted(peers - ring):
            pgs.get(f"rank_{p}")
        marks["exchange connects"][rank] = time.time()
        result.setdefault("peers", {})[rank] = len(peers)
        go_plan.wait()
        _tl.phase = "exchange"
        plan, digest = plan_box["plan"], plan_box["digest"]
        gi = next(i for i, grp in plan_box["groups"].items() if rank in grp)
        member = plan_box["groups"][gi].index(rank)
        mine = plan.groups[gi].sends.of(member)
        result.setdefault("sends", {})[rank] = len(mine)
        _tl.phase = "first iteration"
        k = inprocess.key("done", g.gen, rank)
        g.store.set(k, inprocess.sign(g.secret, k, f"{g.gen} {digest}", g.gen))
        g.trained()
        marks["first iteration"][rank] = time.time()
        g.close()

    pool = SimPool(rank_main)
    cfg = SupervisorConfig(world_size=world, ranks_per_node=rpn, script="-", script_args=[],
                           job_id="bench", log_dir=os.environ.get("TMPDIR", "/tmp") + "/i61cp",
                           spares=rpn, max_restarts=3, abort_timeout=timeout)
    sup = Supervisor(cfg, pool=pool)
    supervisor_mod.listen = listen_apart
    t0 = time.time()
    sup.start()
    pool.refilled.clear()  # (start() refills once itself)
    sup.store = Counting(sup.store, "supervisor")
    deadline = time.time() + timeout
    while not pool.refilled.is_set():  # every rank trained in generation 0
        if time.time() > deadline:
            raise TimeoutError("generation 0 did not train")
        time.sleep(0.05)
    result["start_s"] = time.time() - t0
    COUNTS.clear()
    dead = [5] if case == "crash" else list(range(rpn, 2 * rpn))
    t_kill = time.time()
    for r in dead:
        sup.ranks[r].kill()
    while len(marks["exchange connects"]) < world:
        if time.time() > deadline or sup.returncode is not None:
            raise TimeoutError(f"recovery stalled: {len(marks['process groups'])}/{world} "
                               f"ranks through their process groups; {sup.failure}")
        time.sleep(0.02)
    h = sup.history[-1]
    # start-up agreement and inventory: per rank, its own CPU (the collectives that
    # gather them are modelled by the caller from their measured bytes)
    c0 = time.process_time()
    inv, inv_bytes = synthetic_inventory(rank=0, lost=False)
    t_inv = time.process_time() - c0
    c0 = time.process_time()
    plan, groups = plan_over(world, tp, pp, rpn, dead)
    t_plan = time.process_time() - c0
    plan_box.update(plan=plan, groups=groups, digest=hashlib.sha256(
        repr((plan.iteration, plan.tier, sorted((gi, tuple(g.sends.providers))
                                                for gi, g in plan.groups.items()))).encode()
    ).hexdigest()[:16])
    t_go = time.time()
    pool.refilled.clear()  # (set again by generation 0's marks meanwhile)
    go_plan.set()
    while not pool.refilled.wait(0.05):
        if time.time() > deadline:
            raise TimeoutError("the first iteration's marks never all arrived")
    t_end = time.time()
    agreed = {inprocess.read_signed(sup.store, sup.secret, inprocess.key("done", sup.gen, r),
                                    sup.gen) for r in range(world)}
    pg_end = max(marks["process groups" if gloo == "lazy" else "exchange connects"]
                 .values())
    rdzv_end = max(marks["rendezvous"].values())
    result.update(
        world=world, case=case, gloo=gloo, dead=dead, layout=[tp, pp, world // (tp * pp)], generation=sup.gen,
        agreed=len(agreed) == 1 and None not in agreed, connects=CONNECTS[0],
        seconds={"detection": h["t_detect"] - t_kill, "abort": h["t_ready"] - h["t_detect"],
                 "new generation": h["t_published"] - h["t_ready"],
                 "rendezvous": rdzv_end - h["t_published"],
                 "process groups": pg_end - rdzv_end, "inventory": t_inv,
                 "planning": t_plan, "first iteration": t_end - t_go},
        counts={k: list(v) for k, v in COUNTS.items()}, inventory_bytes=inv_bytes,
        peers_max=max(result.pop("peers").values()),
        sends_max=max(result.pop("sends").values()))
    sup.close()
    return result


def store_costs(n: int = 2000) -> dict:
    """This host's TCPStore: seconds per round trip of one client (a get, sequential)
    and per key served in one multi_get (the server's own work per op)."""
    from reft_ext.cluster.supervisor import listen

    server = listen(multi_tenant=True, wait_for_workers=False)
    c = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False,
                                   wait_for_workers=False)
    keys = [f"k{i}" for i in range(n)]
    c.multi_set(keys, [b"x" * 64] * n)
    rtt, per_key = [], []
    for _ in range(5):
        t = time.perf_counter()
        for k in keys[:200]:
            c.get(k)
        rtt.append((time.perf_counter() - t) / 200)
        t = time.perf_counter()
        c.multi_get(keys)
        per_key.append((time.perf_counter() - t) / n)
    rtt.sort()
    per_key.sort()
    return {"rtt_s": rtt[2], "server_op_s": per_key[2]}
