"""REFT-save: per-iteration sharded snapshots into host memory, protected, committed.
The trainer supplies a :class:`StateAdapter`; this module never imports the
training loop.

Data flow of one snapshot (reft_ext/save/snapshotter.py ties the pieces together):
state tensors (reft_ext/state/layout.py) -> units of one 4 MiB chunk each, filled by a
copy (reft_ext/copy/engine.py) or a protection encode (reft_ext/protect/schemes.py) into
a slot of the store (reft_ext/store/slots.py), hashed as they land -> run when the
schedule says (reft_ext/save/schedules.py, tiers.py) -> sealed and committed
(reft_ext/store/commit.py: on each rank alone, or job-wide with --reft-keep 2).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import torch

from reft_ext.store.checksum import CHUNK, chunk_digest
from reft_ext import _native
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.copy.engine import CopyEngine
from reft_ext.copy.pipeline import Pipelines
from reft_ext.copy.staging import DeviceToHost, Readahead
from reft_ext.state.layout import StateLayout, StreamLayout
from reft_ext.state.regions import Region
from reft_ext.protect.placement import check_placement, place
from reft_ext.protect.schemes import make_protection, snapshot_regions
from reft_ext.save.has import Batch, Unit
from reft_ext.save.schedules import EndOfIteration, make_schedule
from reft_ext.save.tiers import Bandwidth, concurrent_tier2
from reft_ext.state.identity import stamp
from reft_ext.cluster import status as node_status
from reft_ext.save.early_seal import EarlySeal, commit_group
from reft_ext.store.commit import Committer
from reft_ext.store.slots import SnapshotStore
from reft_ext.report.summary import Window
from reft_ext.report.snapshot_log import SnapshotLog
from reft_ext.report.timeline import PipelineEvents
from reft_ext.report.events import record, reft_print  # (reft_print: offered here too)
from reft_ext.testing import fault_point  # the one test injection point (no-op in production)


class StateAdapter(Protocol):
    """What REFT needs from a trainer (megatron/training/reft_integration.py has
    Megatron's; reft_ext/session.py adds what the session needs)."""

    rank: int
    world_size: int
    dp_group: Any            # process group of the sharding group (gloo)
    dp_ranks: list[int]      # its global ranks; member d = dp_ranks[d]
    all_dp_groups: list[list[int]]
    control_group: Any       # world-wide gloo group for agreement

    def replicated_tensors(self) -> list[tuple[str, torch.Tensor]]: ...
    def torch_optimizers(self) -> list: ...  # (AOR) the torch optimizers of its shard
    def owned_tensors(self) -> list[tuple[str, torch.Tensor]]: ...
    def get_meta(self) -> dict: ...
    def set_meta(self, meta: dict) -> None: ...


class ReftSnapshotter:
    """Takes, protects and commits the snapshots of one rank, on the schedule of
    ``--reft-schedule`` (reft_ext/save/schedules.py): ``end-of-iteration`` (blocking copy
    after the optimizer step), ``host-thread`` (a thread copies it all at once, unaware
    of the schedule) or ``has`` (bubbles first, the rest in small chunks beside compute).

    REFT-load (reft_ext/load/) reads what a snapshot is made of from here: ``D``,
    ``member``, ``protection``, ``layout``, ``regions``, ``nbytes``, ``store``, ``aor``."""

    def __init__(self, cfg: ReftConfig, adapter: StateAdapter,
                 events: PipelineEvents | None = None):
        self.cfg, self.a = cfg, adapter
        cfg.resolve_keep(adapter.world_size)  # --reft-keep 0: by the job's size
        check_placement(cfg, adapter.world_size, adapter.all_dp_groups)
        self.D = len(adapter.dp_ranks)
        self.member = adapter.dp_ranks.index(adapter.rank)
        # who keeps whose redundancy, across failure domains (one function for all)
        self.placement = place(adapter.dp_ranks, cfg.node_of)
        self.protection = make_protection(cfg.redundancy, self.placement)
        if adapter.rank == 0 and cfg.enabled and (cfg.redundancy != "none" or cfg.aor):
            reft_print(f"placement ({cfg.ranks_per_node} rank(s) per node): "
                       f"{self.placement.summary(cfg.redundancy, cfg.aor)}; every group "
                       f"alike", event="placement", ring=[self.placement.ranks[d]
                                                          for d in self.placement.ring],
                       domains=list(self.placement.domains))
        self.layout = StateLayout(adapter.replicated_tensors(), adapter.owned_tensors(),
                                  self.D, self.member, self.protection.sub_blocks())
        self.store = SnapshotStore(cfg.job_id, cfg.node_of(adapter.rank), adapter.rank,
                                   cfg.shm_dir, slots=cfg.keep)
        node, rpn = cfg.node_of(adapter.rank), cfg.ranks_per_node
        # REFT's state signals (HEALTHY, SNAP, COMPLETED ...), written by the node's first rank
        self.signals = node_status.NodeSignals(cfg.shm_dir, cfg.job_id, node,
                                               list(range(node * rpn, (node + 1) * rpn)),
                                               adapter.rank % rpn == 0, min_interval_s=1.0)
        self.aor = None  # AORTransport: this rank's shard -> its holder, a peer's replica here
        aor_bytes = 0
        if cfg.enabled and cfg.aor:
            from reft_ext.protect.aor.transport import connect

            self.aor, self.aor_peer_spec = connect(
                self.placement, adapter.torch_optimizers(),
                alloc=lambda n: self.store.buffer("aor", n))
            aor_bytes = self.aor_peer_spec.nbytes
            self._check_aor_verification()
        self.regions = snapshot_regions(self.layout, self.protection, aor_bytes)
        self.nbytes = sum(n for _, n in self.regions.values())
        self.aor_checks = [0, 0]  # verifications, mismatches
        self.job_nbytes = self.nbytes * adapter.world_size  # summed at start()
        # the run's identity in every manifest: REFT-load never takes another run's state
        ident = getattr(adapter, "identity", None)
        self.identity = stamp(ident()) if ident is not None else None
        self.committer = Committer(
            self.store, {"rank": adapter.rank, "member": self.member,
                         "dp_ranks": adapter.dp_ranks, "world_size": adapter.world_size,
                         "protection": self.protection.name,
                         "replica_of": self.protection.replica_of(self.member),
                         "layout": self.layout.signature(), "nbytes": self.nbytes},
            self.regions, commit_group() if cfg.enabled and not cfg.local_commits else
            adapter.control_group, self.identity,
            getattr(adapter, "run_id", None), self.aor, local=cfg.local_commits)
        # snapshot units: one native thread (a unit is one 4 MiB chunk), CPU sources only
        tensors = self.layout.replicated.tensors + self.layout.owned.tensors
        cpu = all(t.device.type == "cpu" for t in tensors)
        self.unit_engine = CopyEngine(1) if _native.C is not None and cpu else None
        # device tensors: D2H into pinned staging on a side stream that waits for an event
        # recorded after the optimizer step (never a pageable copy_ on the training stream)
        self.stager = None if cpu else DeviceToHost(tensors)
        self.store.pin_slots = not cpu and cfg.device_readahead > 0
        if self.stager is not None and self.stager.devices[0].index is not None:
            self.store.device = self.stager.devices[0].index  # locked for the state's GPU
        # the copy-and-hash pipeline (reft_ext/copy/pipeline.py): native threads, one call
        # per region; the reference path (a Python fill and chunk_digest per unit) if None
        self.pipes = Pipelines.for_snapshot(self.nbytes, tensors, self.stager,
                                            lambda: self.events.profile.compute())
        if self.stager is not None:
            self.layout.replicated.device_reader = self.stager
            self.layout.owned.device_reader = self.stager
        self.events = events or PipelineEvents(adapter.rank)
        self.pipeline = getattr(adapter, "pipeline", (1, 1, 1))  # (pp, vpp, micro-batches)
        self.pending: Batch | None = None
        # seconds the training thread waited in the job-wide commit's all-reduce for the
        # slowest rank since the session last took them: waiting the step's own
        # all-reduce (the grad norm's, over the job) does as long without REFT
        self.peer_wait_s = 0.0
        self.last: dict = {}
        # slowest rank's blocking s, per snapshot (the summary's median): the last WINDOW
        self.blocked_history = Window()
        # the [REFT] snapshot lines: one per --log-interval (or per snapshot, when asked)
        self.log = SnapshotLog(cfg.stats_interval, cfg.snapshot_every,
                               cfg.log_every_snapshot, adapter.rank == 0)
        self.recovered_from: str | None = None  # set by REFT-load (reft_ext/load/recover.py)
        self.bandwidth = Bandwidth()  # BW_io of Algorithm 1, measured by every snapshot
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # sharing these cores
        self.concurrent_tier2 = concurrent_tier2(cfg.has_tier2, tensors, local_ranks)
        self.schedule = make_schedule(cfg.schedule if cfg.enabled else EndOfIteration.name,
                                      self.events, self.bandwidth, self.pipeline,
                                      self.concurrent_tier2, device=not cpu)
        if hasattr(self.schedule, "worker"):  # sealed, agreement posted, by its thread
            self.schedule.worker.on_done = EarlySeal(self.committer)
        if self.aor is not None and cpu and self.pipeline[0] > 1:
            # the holder replays its owner's step in this rank's next bubble, not beside
            # the optimizer step every rank waits on (transport.py defer_to_bubbles)
            self.aor.defer_to_bubbles = True
            self.events.listeners.append(self.aor)
        # last: its reservation thread is the only thing a refused start must stop
        # (ReftSession.release_start), so nothing after it may fail
        self._check_memory()

    def _check_aor_verification(self) -> None:
        """A replica that cannot replay its owner bit for bit (an owner on a GPU, a fused
        optimizer) holds the owner's exact bytes at each verification (every
        --reft-aor-verify-every iterations, re-synced on a mismatch) and its CPU replay
        in between: snapshots keep that in their manifest (``aor.exact``) and REFT-load
        says so when it uses one (docs/aor.md). Its checksums are taken on the device
        (owner) and on the apply thread (holder), not on the training thread."""
        self.aor.verify_every = self.cfg.aor_verify_every
        spec = self.aor.owner.spec
        if self.a.rank == 0 and not (spec.bit_identical and self.aor_peer_spec.bit_identical):
            every = self.cfg.aor_verify_every
            when = f"every {every} iterations" if every else "never: --reft-aor-verify-every 0"
            reft_print(f"AOR: the optimizer shards ({spec.kind} on {spec.device}) are "
                       f"replayed on the holders' CPUs, not bit for bit: exact at every "
                       f"verification ({when}, re-synced on a mismatch), the CPU replay "
                       f"in between", event="aor_replay", kind=spec.kind, device=spec.device,
                       every=every)

    def start(self) -> None:
        """Before the first step (after any recovery): holders get their owners' shards
        (a holder whose restored snapshot already has its owner's keeps it). The job's
        snapshot bytes (the snapshot line's figure) are summed once here, at start-up,
        not at every commit. The caller releases the slots' creation
        (``store.release_slots``) once its own start-up collectives are done."""
        total = torch.tensor([self.nbytes], dtype=torch.int64)
        torch.distributed.all_reduce(total, group=self.a.control_group)
        self.job_nbytes = int(total.item())
        if self.aor is not None:
            t0 = time.perf_counter()
            seed = self.aor_seed()
            # beside the first forward-backward (its step and every reader wait for it)
            self.aor.start_initialize(seed=seed, done=lambda: record(
                "aor_initialized", owner=self.aor.owner_rank, seeded=seed is not None,
                kept=self.aor.kept, ms=1e3 * (time.perf_counter() - t0)))

    def aor_seed(self) -> torch.Tensor | None:
        """After a REFT-load: the AOR region of the snapshot this rank restored (its
        replica of its owner's shard at the restored iteration), else None. Only a
        candidate: AORTransport.initialize keeps it only if its checksum is the owner's."""
        c = self.store.committed() if self.recovered_from is not None else None
        m = self.store.manifests().get(int(c["slot"])) if c else None
        aor = (m or {}).get("aor") or {}
        if m is None or int(m["iteration"]) != int(c["iteration"]) or not aor.get("valid") \
                or aor.get("owner") != self.aor.owner_rank or Region.AOR not in m["regions"]:
            return None
        off, n = m["regions"][Region.AOR][:2]
        return self.store.data(int(c["slot"]), int(m["nbytes"]))[off:off + n]

    def maybe_verify_aor(self, iteration: int) -> None:
        """--reft-aor-verify-every: replica vs owner checksums (collective per group)."""
        every = self.cfg.aor_verify_every
        if self.aor is None or not every or iteration % every:
            return
        r = self.aor.verify(iteration)
        self.aor_checks[0] += 1
        self.aor_checks[1] += not r["match"]

    def host_bytes_per_node(self) -> int:
        """Shared memory this job holds on each node: --reft-keep slots per rank and the
        live AOR replica (a peer's optimizer shard) beside them."""
        return (self.cfg.keep * self.nbytes + self.regions[Region.AOR][1]) * \
            self.cfg.ranks_per_node

    def _check_memory(self) -> None:
        """--reft-keep slots per rank (and the live AOR replica), for every rank of the
        node: fail now, not at a SIGBUS."""
        per_node = self.host_bytes_per_node()
        limit = self.cfg.host_memory_limit_bytes
        if limit and per_node > limit:
            raise ReftConfigError(
                f"--reft-host-memory-limit: snapshots need {per_node / 2**20:.1f} MiB per node "
                f"({self.cfg.keep} slots (--reft-keep) x {self.nbytes / 2**20:.1f} MiB x "
                f"{self.cfg.ranks_per_node} ranks), limit is {limit / 2**20:.1f} MiB; raise "
                f"the limit, lower --reft-keep or snapshot less state")
        # both slots and the live AOR replica: space checked now, not at the first
        # snapshot (too little /dev/shm is a clear error before any work is done); the
        # pages of segments that do not exist yet (a fresh start, a replaced node's rank:
        # over a GB to allocate and map) are reserved by a thread while REFT-load, the
        # data and the first iteration go on; the first snapshot waits for them
        aor = {"aor": self.aor_peer_spec.nbytes} if self.aor is not None else {}
        self.store.reserve(self.nbytes, buffers=aor, background=True)

    # ---- save -------------------------------------------------------------------
    def maybe_snapshot(self, iteration: int) -> bool:
        """Called after the optimizer step of ``iteration``: the schedule copies now
        (end-of-iteration: training waits) or during the next forward/backward."""
        if not self.cfg.enabled or iteration % self.cfg.snapshot_every:
            return False
        self.flush()
        with self.events.span(self.schedule.span, "snapshot", iteration=iteration):
            self.schedule.submit(self._begin(iteration))
        if self.schedule.inline:
            self._finish(wait_s=None)
        return True

    def before_optimizer_step(self) -> None:
        """The state is about to change: the snapshot in flight must be complete."""
        self.flush()

    def flush(self) -> None:
        """Finish and commit the snapshot in flight, if any (also at exit)."""
        if self.pending is None:
            return
        with self.events.span("snapshot-drain", "snapshot", iteration=self.pending.iteration):
            wait = self.schedule.drain()
        self._finish(wait_s=wait)

    def _begin(self, iteration: int) -> Batch:
        """Units of work for the state as it is now, metadata captured now."""
        lay, units = self.layout, []
        if self.stager is not None:
            self.stager.mark()  # the state of this step: what the side stream copies
        self.signals.set(node_status.SNAP, detail=f"snapshot of iteration {iteration}")
        slot, buf = self.store.begin(self.nbytes)
        start = lay.slice_range(self.member)[0]
        fills = {
            Region.OWN: lambda dst, lo: self._copy(lay.replicated, start + lo, dst),
            Region.REDUNDANCY: lambda dst, lo: self.protection.encode(lay, dst, lo),
            Region.OWNED: lambda dst, lo: self._copy(lay.owned, lo, dst),
            Region.AOR: self._copy_aor,
        }
        batch = Batch(units, iteration)
        streams = {Region.OWN: (lay.replicated, start), Region.OWNED: (lay.owned, 0)}
        ahead = self.stager is not None and self.cfg.device_readahead > 0 and buf.is_pinned()
        native = self.pipes is not None and (self.stager is None or buf.is_pinned())
        # host bytes copied as they are (an ARC replica's slice, the live AOR replica):
        # the native copy hashes them in the same pass as the rest (issue 57)
        plain = dict(streams)
        replica = self.protection.replica_of(self.member)
        if replica is not None:
            plain[Region.REDUNDANCY] = (lay.replicated, lay.slice_range(replica)[0])
        if self.aor is not None:  # resolved once the replica has applied this step
            plain[Region.AOR] = (self._aor_stream, 0)
        for region, (off, n) in self.regions.items():
            spans = [(lo, buf[off + lo:off + min(n, lo + CHUNK)]) for lo in range(0, n, CHUNK)]
            fill, group = fills[region], None
            if native and region in plain:  # one native call for many units
                stream, base = plain[region]
                group = self.pipes.group(stream, [(base + lo, d) for lo, d in spans],
                                         lambda r=region: self._fault_once(batch, r))
            elif ahead and region in streams:  # device bytes straight into the locked slot
                stream, base = streams[region]
                ra = Readahead(self.stager, stream, [(base + lo, d) for lo, d in spans],
                               self.cfg.device_readahead)
                fill = lambda dst, lo, ra=ra: ra.fill(lo // CHUNK)  # noqa: E731
            for index, (lo, dst) in enumerate(spans):
                u = Unit(region, index, dst.numel(), self._unit(batch, fill, dst, lo, region),
                         batch=group)
                if group is not None:
                    u.run = lambda u=u, g=group: g([u], "drain")[0]  # noqa: E731
                units.append(u)
        self.pending = batch
        batch.slot, batch.t0 = slot, time.perf_counter()
        # captured now (copies), made JSON by the seal, on the snapshot thread (issue 57)
        batch.meta = self.a.get_meta()
        return batch

    def _fault_once(self, batch: Batch, region: Region) -> None:
        if region != "own" and not batch.fault_checked:
            batch.fault_checked = True  # halfway through the write (reft_ext/testing)
            fault_point("snapshot-write", iteration=batch.iteration)

    def _copy(self, stream, lo: int, dst: torch.Tensor) -> None:
        """Stream bytes [lo, lo+len(dst)) into dst: one native copy thread (non-temporal
        stores) when the extension is built, else torch's copy; padding reads as zeros."""
        if self.unit_engine is None:
            stream.read(lo, lo + dst.numel(), dst)
            return
        pieces = stream.pieces(lo, lo + dst.numel())
        if pieces:
            self.unit_engine.submit([(stream.tensors[p.index], dst, p.src_off, p.dst_off, p.n)
                                     for p in pieces]).wait()
        covered = sum(p.n for p in pieces)
        if covered < dst.numel():
            dst[covered:].zero_()

    def _aor_stream(self) -> StreamLayout:
        """The live AOR replica as a stream, once it has applied the step this snapshot
        is of (the apply thread may be a step behind, or still initializing)."""
        self.aor.wait()
        return StreamLayout([("aor", self.aor.replica.buffer)])

    def _copy_aor(self, dst: torch.Tensor, lo: int) -> None:
        self.aor.wait()  # the replica has applied the step this snapshot is of
        dst.copy_(self.aor.replica.buffer[lo:lo + dst.numel()])

    def _unit(self, batch, fill, dst, lo, region):
        def run() -> int:
            if region != "own" and not batch.fault_checked:
                batch.fault_checked = True  # halfway through the write (reft_ext/testing)
                fault_point("snapshot-write", iteration=batch.iteration)
            with torch.no_grad():
                fill(dst, lo)
            return chunk_digest(dst)
        return run

    def _finish(self, wait_s: float | None) -> None:
        """Seal the snapshot in flight, commit it, say so (rank 0)."""
        batch, self.pending = self.pending, None
        sums = batch.sums if batch.sums is not None else \
            self.committer.seal(batch.slot, batch.iteration, batch.digests, batch.meta)
        self.bandwidth.record(self.nbytes, batch.busy_s)  # bytes/s of the copy + hash
        blocked = batch.busy_s if wait_s is None else wait_s
        with self.events.span("snapshot-commit", "snapshot", iteration=batch.iteration):
            t0 = time.perf_counter()
            self.committer.commit(batch.slot, batch.iteration, batch.agreement)
            if not self.committer.local:
                self.peer_wait_s += time.perf_counter() - t0
        self.signals.set(node_status.COMPLETED, batch.iteration)
        self.last = {"iteration": batch.iteration, "blocked_s": blocked, **batch.by_how,
                     "sums": sums}
        self.blocked_history.append(blocked)  # this rank's (the summary is rank 0's)
        it, committed_ms = batch.iteration, 1000 * (time.perf_counter() - batch.t0)
        if self.log.stale(it):  # a rollback left the window before its last snapshot
            self.log_interval()
        schedule = None if wait_s is None else self.schedule.name  # (None: no tiers)
        tiers = None if wait_s is None else dict(batch.by_how)
        self.log.add(it, blocked, batch.busy_s, committed_ms, tiers)
        # the slowest rank's times: a job-wide MAX (16 B), so only for the last snapshot
        # of each --log-interval window, never a collective per iteration: of the window
        # for its line, of the snapshot with --reft-log-every-snapshot (the same on all ranks)
        slowest, each = self.log.closes_window(it), self.cfg.log_every_snapshot
        stats = torch.tensor([blocked, batch.busy_s] if each else
                             [self.log.max_blocked_s, self.log.max_copy_s], dtype=torch.float64)
        if slowest:
            torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX,
                                         group=self.a.control_group)
        maxima = (stats[0].item(), stats[1].item())
        if self.a.rank == 0:  # the snapshot's own times: the slowest rank's where gathered
            b, c = maxima if each and slowest else (blocked, batch.busy_s)
            self.log.snapshot(it, self._what(), schedule, tiers, b, c, committed_ms,
                              each and slowest)
        if slowest:
            self.log_interval(None if each else maxima)

    def _what(self) -> dict:
        """The job's snapshot, as the [REFT] lines and their events give it."""
        return dict(bytes=self.job_nbytes, ranks=self.a.world_size,
                    per_rank={k: n for k, (_, n) in self.regions.items()},
                    protection=self.protection.name)

    def log_interval(self, maxima: tuple[float, float] | None = None) -> None:
        """The [REFT] snapshots line of the window so far (rank 0), then a new window;
        also at the end of training, for the window the run ends in."""
        self.log.interval(self._what(), self.schedule.name if self.log.tiers else None,
                          maxima)

    def abandon(self, reader=None) -> None:
        """A failed generation (in-process restart): the snapshot in flight is dropped
        uncommitted (its slot was never the committed one), no peer is waited for, the
        threads stop and the segments are kept, mapped, for the next session of this
        process: the committed snapshot in them is what this rank rolls back to.
        ``reader(store)``: called once nothing writes the slots any more, before the
        hand-over; the thread it may return still reads them (the next store waits)."""
        self.pending = None
        self.schedule.close()
        self._unlisten_aor()
        aor_done = self.aor is None or self.aor.abandon()
        if self.unit_engine is not None:
            self.unit_engine.close()
        if self.stager is not None:
            self.stager.close()
        if aor_done:  # an AOR thread still applying a message must not lose its mapping
            # still mapped for the next session of this process
            self.store.hand_over(reader=reader(self.store) if reader else None)

    def _unlisten_aor(self) -> None:
        if self.aor is not None and self.aor in self.events.listeners:
            self.events.listeners.remove(self.aor)

    def close(self, remove: bool) -> None:
        self.flush()
        self._unlisten_aor()
        if self.aor is not None:
            self.aor.close()
        if self.unit_engine is not None:
            self.unit_engine.close()
        if self.stager is not None:
            self.stager.close()
        self.schedule.close()
        if remove:
            self.store.remove()
        else:
            self.store.close()
