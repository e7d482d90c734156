"""ReftSession's start-up: REFT-load (host memory, the flushed tier, a reshard after a
shrink) into the trainer's state, the recovery counted by its tier, and ``on_start``
(AOR replicas, heartbeat, the node's watcher, the SIGTERM guard).

A mixin of :class:`~reft_ext.session.ReftSession`, apart from its per-iteration hooks
and its end: the start-up is what joins the most of reft_ext (load, cluster, state
identity) and runs once per process, the hooks every iteration. It reads the session's
``cfg``, ``adapter``, ``state``, ``snap``, ``fused_load`` and ``_term`` (set in
``ReftSession.__init__``) and sets its ``heartbeat``.
"""

from __future__ import annotations

import os

import torch

from reft_ext.cluster import inprocess
from reft_ext.cluster import status as node_status
from reft_ext.load import preverify
from reft_ext.load.recover import recover
from reft_ext.report import summary
from reft_ext.report.events import record
from reft_ext.save.snapshotter import reft_print
from reft_ext.state.identity import refuse_other_runs
from reft_ext.testing import fault_point


class SessionStartup:
    """The start-up methods of :class:`~reft_ext.session.ReftSession` (the interface's
    ``recover``, ``count_recovery``, ``recovered_from_checkpoint`` and ``on_start``)."""

    def recover(self, persistent_iteration: int | None) -> int | None:
        """Collective. The iteration restored from host memory (or the flushed tier, or
        resharded after a shrink) into the trainer's state, or None: the trainer loads
        its persistent checkpoint instead (``persistent_iteration``, newer wins)."""
        # another run's snapshots (same --reft-job-id, other seed/model/data...): refuse
        # job-wide before anything is read or imported
        from reft_ext.load.flushed import flushed_manifests

        on_disk = flushed_manifests(self.cfg.flush_dir, self.adapter.rank) \
            if self.cfg.flush_dir else None
        why = refuse_other_runs(self.snap.store, self.cfg.flush_dir, self.adapter.identity(),
                                self.adapter.control_group, on_disk)
        if why:
            from reft_ext.load.errors import IdentityMismatch

            raise IdentityMismatch(why)
        if self.cfg.flush_dir:  # save-on-failure tier: back into memory when newer
            from reft_ext.load.flushed import import_flushed

            flushed = import_flushed(self.snap.store, self.cfg.flush_dir, self.snap.nbytes)
            if flushed is not None:
                reft_print(f"rank {self.adapter.rank}: host memory had nothing newer than "
                           f"the flushed snapshot of iteration {flushed} in {self.cfg.flush_dir}: "
                           f"loaded it into host memory", event="imported_flushed",
                           rank=self.adapter.rank, iteration=flushed,
                           flush_dir=self.cfg.flush_dir)
        from reft_ext.load.reshard import reshard_from_memory

        # after an elastic shrink (docs/nodes.md): the old job's snapshots, resharded
        it = reshard_from_memory(self.snap, persistent_iteration, direct=self.fused_load)
        if it is not None:
            self.count_recovery("memory, resharded after a shrink")
            return it
        # a fused restore that fails a checksum leaves bytes in the model that only a
        # full persistent load replaces (reft_ext/load/recover.py recover)
        it = recover(self.snap, persistent_iteration, fuse=self.fused_load)
        if it is not None:
            self.count_recovery(self.snap.recovered_from or "host memory")
        return it

    def count_recovery(self, tier: str) -> None:
        """One recovery of the job, by the tier that served it (kept in the state)."""
        summary.count_recovery(self.state.extra, tier)

    def recovered_from_checkpoint(self, path: str) -> None:
        """The trainer loaded its persistent checkpoint after REFT-load found nothing
        newer: logged and counted as a recovery like the others."""
        if self.adapter.rank == 0:
            reft_print(f"recovered iteration {self.state.iteration} from the persistent "
                       f"checkpoint {path}")
        # every rank (one line above)
        record("recovered_persistent", iteration=self.state.iteration, path=path)
        self.count_recovery("the persistent checkpoint")

    def on_start(self, state) -> None:
        fault_point("on-start", iteration=state.iteration)  # --inject-fault ...@on-start
        preverify.discard()  # checksums begun at an abandon that no REFT-load took
        self.snap.start()  # AOR: every holder gets its owner's (restored) shard
        if self.cfg.hang_timeout > 0:  # before the watcher reads it; armed after 1 iteration
            from reft_ext.cluster.heartbeat import Heartbeat

            self.heartbeat = Heartbeat(self.snap.store.dir, self.adapter.rank, state.iteration)
            self.snap.events.heartbeat = self.heartbeat
        self._start_watcher()
        self.snap.signals.set(node_status.HEALTHY,
                              detail=f"training from iteration {state.iteration}")
        self._term.install()
        # a replacement's slots (a GB or more) are made from here, beside the first
        # forward-backward: populating them holds a core and the process's mmap lock,
        # which stalled the start-up's collectives of every rank by 0.2-0.4 s
        self.snap.store.release_slots()

    def _start_watcher(self) -> None:
        """Save-on-failure: the node's first rank starts a watcher of the node's workers
        (its own session, so it outlives them; reft_ext/cluster/watcher.py)."""
        from reft_ext.cluster.watcher import spawn

        a, sig = self.adapter, self.snap.signals
        pids = [None] * a.world_size
        torch.distributed.all_gather_object(pids, os.getpid(), group=a.control_group)
        if not sig.leader:
            return
        cfg, mine = self.cfg, [pids[r] for r in sig.ranks]
        if not inprocess.enabled():  # torchrun: one watcher per start of the workers
            spawn(cfg.shm_dir, cfg.job_id, sig.node, mine, cfg.flush_dir, ranks=sig.ranks,
                  hang_timeout=cfg.hang_timeout)
            return
        # in-process: the node's watcher stays for the job and is handed each
        # generation's ranks (no Python start per node beside the first iteration after
        # a recovery); one is started where the node has none (the first start, a node
        # whose ranks all died, a spare node)
        gen = int(os.environ.get(inprocess.ENV_GENERATION, "0"))
        if node_status.adopt_watcher(cfg.shm_dir, cfg.job_id, sig.node, gen, mine, sig.ranks):
            return
        node_status.kill_watcher(cfg.shm_dir, cfg.job_id, sig.node)  # one not adopting
        # written first: a list a watcher of an earlier generation left is never adopted
        node_status.write_watch_list(cfg.shm_dir, cfg.job_id, sig.node, gen, mine, sig.ranks)
        spawn(cfg.shm_dir, cfg.job_id, sig.node, mine, cfg.flush_dir, ranks=sig.ranks,
              hang_timeout=cfg.hang_timeout, adopt=True)
