"""The in-process supervisor's workers on many nodes: one node agent per node, reached
through the job's store (the coordinator's side; the agent is node_agent.py).

Every key below is under ``reft/ip/`` and every value that steers anything is signed
with the job's secret (reft_ext/cluster/inprocess.py ``sign``):

========================  =========  ===============================================
``node/<n>``              agent      registered: host, pid, workers started at once
``hb/<n>``                agent      heartbeat counter (every ``HEARTBEAT_S``)
``exit/<n>.<k>``          agent      worker k of node n ended, with its exit code
``cmd/<n>/<i>``           pool       the agent's i-th command: spawn, kill, stop
``ev/<i>``                anyone     "something happened" (unsigned: it only wakes)
========================  =========  ===============================================

Ranks live in *slots*: slot s holds ranks s*P .. s*P+P-1, one REFT failure domain.
Slot s starts on node s; nodes beyond the job's are spare nodes. A rank that died on a
node that is still alive (its heartbeat goes on) is replaced by a worker of the same node
(a warm one when the node keeps one), so the slot's memory in that node's /dev/shm is
its own again; a node whose heartbeat stopped for ``node_timeout`` s is lost, and its slot
moves whole to a spare node, every rank to one of the spare's warm workers. Nothing here
polls at a fixed rate: :meth:`NodePool.update` blocks on the next ``ev/<i>`` (bounded by
the heartbeat check).
"""

from __future__ import annotations

import datetime
import json
import signal
import time

import torch

from reft_ext.cluster.inprocess import key, read_signed, sign, verify
from reft_ext.cluster.pool import Pool, Worker

HEARTBEAT_S = 0.25   # an agent's heartbeat period
NODE_TIMEOUT_S = 3.0  # a node whose heartbeat stopped this long is lost
PING_TIMEOUT_S = 1.0  # a node that does not answer a ping (a beat at once) this fast is lost
MAX_EVENTS = 4096     # events read per wake-up (a forged counter cannot make it more)
GAP_S = 5.0           # an event counted but never written is given up after this


def wid_of(node: int, k: int) -> str:
    return f"{node}.{k}"


class _Node:
    def __init__(self, n: int, host: str, started: int):
        self.n, self.host, self.started = n, host, started
        self.hb, self.hb_seen = None, time.monotonic()
        self.lost = False
        self.pinged: float | None = None  # when asked for an immediate beat


class _NodeWorker(Worker):
    def __init__(self, pool: "NodePool", node: _Node, k: int):
        super().__init__(wid_of(node.n, k))
        self.pool, self.node = pool, node

    def poll(self) -> int | None:
        code = self.pool.exits.get(self.wid)
        if code is None and self.pool.is_lost(self.node):
            return -signal.SIGKILL  # its node is gone, and it with it
        return code

    def probe(self) -> None:
        self.pool.ping(self.node)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if not self.pool.is_lost(self.node):
            self.pool.command(self.node.n, op="kill", wid=self.wid, sig=int(sig))

    def wait_dead(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                return False
            self.pool.update(0.1)
        return True


class NodePool(Pool):
    """Workers on ``alloc_nodes`` node agents; the first ``nodes`` hold the job's slots."""

    def __init__(self, nodes: int, alloc_nodes: int, ranks_per_node: int, spares_per_node: int,
                 node_timeout: float = NODE_TIMEOUT_S, register_timeout: float = 600.0):
        if not 1 <= nodes <= alloc_nodes:
            raise ValueError(f"{nodes} training node(s) of {alloc_nodes} allocated")
        self.n_train, self.n_alloc, self.p = nodes, alloc_nodes, ranks_per_node
        self.spares_per_node, self.node_timeout = spares_per_node, node_timeout
        self.register_timeout = register_timeout
        self.nodes: dict[int, _Node] = {}
        self.slot_node: dict[int, int] = {}
        self.retired: set[int] = set()  # nodes swapped out as stragglers (never reused)
        self.handed: dict[int, set[int]] = {}  # node -> worker indices given a rank
        self.exits: dict[str, int] = {}
        self.all: list[_NodeWorker] = []
        self._next_ev = 1
        self._gaps: dict[int, float] = {}  # event indices counted but not written yet
        self._hb_checked = 0.0

    def say(self, msg: str) -> None:
        print(f"[inprocess] {msg}", flush=True)

    # ---- start -------------------------------------------------------------------
    def start(self, store, host, port, secret_hex) -> None:
        self.store, self.secret = store, bytes.fromhex(secret_hex)
        deadline, missing = time.time() + self.register_timeout, list(range(self.n_alloc))
        while missing:
            for n in list(missing):
                got = read_signed(store, self.secret, key("node", n), 0)
                if got is not None:
                    d = json.loads(got)
                    self.nodes[n] = _Node(n, str(d["host"]), int(d["workers"]))
                    self.handed[n] = set()
                    missing.remove(n)
            if missing and time.time() > deadline:
                raise RuntimeError(f"node(s) {missing} did not register within "
                                   f"{self.register_timeout:.0f} s (their node agents "
                                   f"never reached {host}:{port})")
            if missing:
                self.update(0.5)
        self.slot_node = {s: s for s in range(self.n_train)}
        self.say(f"{self.n_alloc} node(s) registered: slots " + ", ".join(
            f"{s}->{self.nodes[n].host}" for s, n in self.slot_node.items()) +
            f"; spare node(s): {[self.nodes[n].host for n in self._spare_nodes()] or 'none'}")

    def _spare_nodes(self) -> list[int]:
        used = set(self.slot_node.values()) | self.retired
        return [n for n in sorted(self.nodes) if n not in used and not self.is_lost(self.nodes[n])]

    # ---- what happened -------------------------------------------------------------
    def update(self, timeout: float) -> None:
        """Block until the next event or ``timeout``; take in exits and heartbeats."""
        first = min(self._gaps, default=self._next_ev)
        try:
            self.store.wait([key("ev", first)], datetime.timedelta(seconds=timeout))
        except torch.distributed.DistStoreError:
            pass
        seq = self.store.add(key("evseq"), 0)
        # A poster counts (evseq) before it writes ev/<n>: an index not written yet is
        # a gap, looked at again on every wake-up. Anyone reaching the store can bump
        # the counter, so a gap is given up after GAP_S, and at most MAX_EVENTS are
        # read (multi_get would wait for keys that may never come).
        idx = sorted(set(self._gaps) | set(range(max(self._next_ev, seq + 1 - MAX_EVENTS),
                                                 seq + 1)))
        self._next_ev = max(self._next_ev, seq + 1)
        now = time.monotonic()
        for i in idx:
            k = key("ev", i)
            if not self.store.check([k]):
                if now - self._gaps.setdefault(i, now) > GAP_S:
                    del self._gaps[i]
                continue
            self._gaps.pop(i, None)
            what = self.store.get(k).decode("utf-8", "replace").split()
            if len(what) == 2 and what[0] == "exit":
                self._take_exit(what[1])
        if time.monotonic() - self._hb_checked >= HEARTBEAT_S:
            self._check_heartbeats()

    def _take_exit(self, wid: str) -> None:
        got = read_signed(self.store, self.secret, key("exit", wid), 0)
        if got is not None and got.lstrip("-").isdigit():
            self.exits[wid] = int(got)

    def _check_heartbeats(self) -> None:
        self._hb_checked = now = time.monotonic()
        live = [n for n, node in self.nodes.items() if not node.lost]
        ks = [key("hb", n) for n in live]
        raws = (self.store.multi_get(ks) if self.store.check(ks) else
                [self.store.get(k) if self.store.check([k]) else b"" for k in ks])
        for n, raw in zip(live, raws):
            node = self.nodes[n]
            value = verify(self.secret, key("hb", n), raw, 0)
            if value is not None and value != node.hb:
                node.hb, node.hb_seen, node.pinged = value, now, None
            elif now - node.hb_seen > self.node_timeout or (
                    node.pinged is not None and now - node.pinged > PING_TIMEOUT_S):
                self._lose(node, f"no heartbeat for {now - node.hb_seen:.1f} s" +
                           (f", no answer to a ping for {now - node.pinged:.1f} s"
                            if node.pinged is not None else ""))

    def _lose(self, node: _Node, why: str) -> None:
        """Give the node up. Should it be alive after all (a stall, not a loss), its
        agent stops every worker, so no rank ever runs twice."""
        node.lost = True
        self.say(f"node {node.host} (node {node.n}) lost: {why}")
        try:
            self.command(node.n, op="stop")
        except Exception:  # noqa: BLE001 - it is gone anyway
            pass

    def ping(self, node: _Node) -> None:
        """A rank of ``node`` is neither ready nor dead after an abort: ask its agent for
        a beat now, so that a lost node is known in about a round trip, not
        ``node_timeout`` (each node once per silence)."""
        if not node.lost and node.pinged is None:
            node.pinged = time.monotonic()
            self.command(node.n, op="ping")

    def is_lost(self, node: _Node) -> bool:
        return node.lost

    # ---- orders ---------------------------------------------------------------------
    def command(self, n: int, **cmd) -> None:
        i = self.store.add(key("cmdseq", n), 1)
        k = key("cmd", n, i)
        self.store.set(k, sign(self.secret, k, json.dumps(cmd), i))

    def _free(self, node: _Node) -> list[int]:
        """Worker indices of ``node`` not given a rank and not ended, warm ones first."""
        free = [k for k in range(node.started) if k not in self.handed[node.n]
                and wid_of(node.n, k) not in self.exits]
        return sorted(free, key=lambda k: not self.store.check([key("warm", wid_of(node.n, k))]))

    def _hand(self, node: _Node, k: int) -> _NodeWorker:
        self.handed[node.n].add(k)
        w = _NodeWorker(self, node, k)
        self.all.append(w)
        return w

    def take(self, rank: int) -> Worker:
        slot = rank // self.p
        node = self.nodes[self.slot_node[slot]]
        if node.n in self.retired and not self._spare_nodes():  # taken meanwhile
            self.retired.discard(node.n)
            self.say(f"slot {slot} stays on node {node.host}: no spare node is left to "
                     f"take it over from the straggler")
        if node.lost or node.n in self.retired:
            spares = self._spare_nodes()
            if not spares:
                raise RuntimeError(f"node {node.host} (slot {slot}) is lost and no spare "
                                   f"node is left to take its ranks")
            node = self.nodes[spares[0]]
            self.slot_node[slot] = node.n
            self.say(f"slot {slot} (ranks {slot * self.p}-{slot * self.p + self.p - 1}) "
                     f"moves to spare node {node.host}")
        free = self._free(node)
        if not free:  # no warm worker there: a cold one
            self.command(node.n, op="spawn", count=1)
            free = [node.started]
            node.started += 1
        return self._hand(node, free[0])

    def warm(self, w: Worker) -> bool:
        return self.store.check([key("warm", w.wid)])

    def swap_capacity(self) -> int:
        return len(self._spare_nodes())

    def retire(self, slot: int) -> None:
        """The slot's node is a straggler: its ranks move whole to a spare node (at
        :meth:`take`), its own free workers are stopped, and it is never used again."""
        n = self.slot_node[slot]
        self.retired.add(n)
        for k in self._free(self.nodes[n]):
            self.command(n, op="kill", wid=wid_of(n, k), sig=int(signal.SIGKILL))
            self.handed[n].add(k)

    def refill(self) -> None:
        """Each live node that holds a slot keeps ``spares_per_node`` free workers."""
        for n in set(self.slot_node.values()):
            node = self.nodes[n]
            short = self.spares_per_node - len(self._free(node))
            if short > 0 and not node.lost:
                self.command(n, op="spawn", count=short)
                node.started += short

    def workers(self) -> list[Worker]:
        return list(self.all)

    def describe(self) -> str:
        return "slots " + ", ".join(f"{s}->{self.nodes[n].host}" for s, n in
                                    sorted(self.slot_node.items())) + \
            f"; spare node(s) left: {len(self._spare_nodes())}"

    def close(self) -> None:
        """Every agent stops its workers and exits."""
        for n, node in self.nodes.items():
            if not node.lost:
                try:
                    self.command(n, op="stop")
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
