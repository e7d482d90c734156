"""REFT-specific damage for ``--inject-fault`` (tests and demos): a lost node's shared
memory, a flipped byte or a rewritten manifest / commit pointer in a rank's committed
snapshot.

reft_ext/testing/fault_observer.py decides *when* (rank, phase, iteration, attempt)
and sends the signal: its one observer sits behind
:func:`reft_ext.testing.fault_point` and fires the specs at their moments (the library's
own moments, ``snapshot-write``, ``commit``, ... included). For the REFT part of a mode it
calls ``fault_point("node-loss")`` / ``fault_point("corrupt", mode=...)``, which the
observer hands to the :class:`ReftFaults` of this rank's session (attached when the
session opens). The production objects (session, snapshotter, store) hold no test code:
this module reads their state from outside.
"""

from __future__ import annotations

import json
import shutil
import sys

from reft_ext.report.files import open_nofollow
from reft_ext.state.regions import Region


def _emit(msg: str) -> None:
    """One line in one write (the trainer's ``emit``: ranks share a pipe)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


class ReftFaults:
    """The REFT damage of one rank's session (reft_ext/session.py), called by the
    fault observer (fault_observer.py) with the points in POINTS."""

    POINTS = ("node-loss", "corrupt")

    def __init__(self, session):
        self.session = session

    def __call__(self, point: str, **info) -> None:
        if point == "node-loss":
            self.wipe_node()
        elif point == "corrupt":
            self.corrupt(info["mode"])

    def wipe_node(self) -> None:
        """Node loss: the failure domain's shared memory disappears with the node."""
        from reft_ext.store.paths import job_dir

        s = self.session
        d = job_dir(s.snap.store.job, s.cfg.shm_dir)
        shutil.rmtree(d, ignore_errors=True)
        # a [FAULT] line like the others (reft_print would prefix it with [REFT] too)
        _emit(f"[FAULT] wiped failure domain {s.cfg.node_of(s.adapter.rank)} ({d})")

    def corrupt(self, mode: str) -> None:
        """``--inject-fault ...:corrupt*``: damage this rank's committed snapshot. The
        bytes are mapped shared on a tmpfs: the change is what any process reads from
        now on, a kill right after does not lose it."""
        s = self.session
        snap, a = s.snap, s.adapter
        store = snap.store
        c = store.committed()
        if c is None:
            return
        slot, it, who = c["slot"], int(c["iteration"]), f"rank {a.rank}'s"
        if mode in ("corrupt", "corrupt-replica"):
            region = Region.OWN if mode == "corrupt" else Region.REDUNDANCY
            off, n = snap.regions[region]
            if n == 0:
                _emit(f"[FAULT] {who} snapshot has no {region} region: nothing flipped")
                return
            store.data(slot, snap.nbytes)[off + n // 2] ^= 0xFF
            if mode == "corrupt":
                _emit(f"[FAULT] flipped a byte of {who} snapshot of iteration {it}")
            else:
                j = snap.protection.replica_of(snap.member)
                held = f"{snap.protection.name} redundancy block" if j is None else \
                    f"ARC replica of rank {a.dp_ranks[j]}'s slice"
                _emit(f"[FAULT] flipped a byte of {who} {held} in its snapshot of "
                      f"iteration {it}")
            return
        self._rewrite_json(mode, slot, it, who)

    def _rewrite_json(self, mode: str, slot: int, it: int, who: str) -> None:
        """Still valid JSON, one value changed, the stored checksum (self_sha256) kept:
        only the file's own checksum can tell."""
        from reft_ext.store.slots import from_jsonable, to_jsonable

        s = self.session
        store = s.snap.store
        if mode == "corrupt-manifest":
            path = store._path(store._name(slot, "json"))
            with open(path) as f:
                m = json.load(f)
            meta = from_jsonable(m["meta"])
            counters = meta["counters"]
            was = counters["consumed_train_samples"]
            counters["consumed_train_samples"] = was + s.adapter.global_batch_size
            m["meta"] = to_jsonable(meta)
            change = (f"consumed_train_samples {was} -> "
                      f"{counters['consumed_train_samples']} in {who} manifest {path} of "
                      f"iteration {it}")
        else:  # corrupt-committed
            path = store._path(f"rank{s.adapter.rank}.committed")
            with open(path) as f:
                m = json.load(f)
            m["iteration"] = it + 1
            change = f"{who} commit pointer {path}: iteration {it} -> {it + 1}"
        with open_nofollow(path) as f:
            json.dump(m, f)
        _emit(f"[FAULT] changed {change} (checksum kept)")
