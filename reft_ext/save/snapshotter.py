"""REFT-save: per-iteration sharded snapshots into host memory, protected, committed
job-wide. The trainer supplies a :class:`StateAdapter`; this module never imports the
training loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Protocol

import torch

from reft_ext.save.bubbles import bubble_time, snapshot_time, tier_split
from reft_ext.store.checksum import CHUNK, checksum, chunk_digest, combine
from reft_ext.store.checksum import DEFAULT as CHECKSUM
from reft_ext import _native
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.copy.engine import CopyEngine
from reft_ext.state.layout import StateLayout
from reft_ext.protect.schemes import make_protection, snapshot_regions
from reft_ext.save.has import TIER1, TIER2, Batch, HasWorker, Unit
from reft_ext.state.identity import stamp
from reft_ext.cluster import status as node_status
from reft_ext.store.slots import SnapshotStore, to_jsonable
from reft_ext.report.timeline import PipelineEvents

log = logging.getLogger("reft")


class StateAdapter(Protocol):
    """What REFT needs from a trainer (see megatron/training/reft_hooks.py)."""

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


def reft_print(msg: str) -> None:
    """One ``[REFT]`` line in one write (ranks share a pipe: print() writes the text and
    the newline separately, so lines of two ranks could run together)."""
    sys.stdout.write(f"[REFT] {msg}\n")
    sys.stdout.flush()




def _concurrent_tier2(cfg: ReftConfig, layout: StateLayout, local_ranks: int) -> bool:
    """Can a copy run beside compute without taking the compute's place? A device-to-host
    copy can (copy engines); on a CPU only when the node has cores the ranks' compute
    threads leave idle. Otherwise a chunk copied "beside" compute just delays it, and on
    an early pipeline stage delays every later stage too: better at the drain."""
    if cfg.has_tier2 != "auto":
        return cfg.has_tier2 == "concurrent"
    tensors = layout.replicated.tensors + layout.owned.tensors
    if any(t.device.type != "cpu" for t in tensors):
        return True
    return _native.num_cpus() > local_ranks * torch.get_num_threads()


class ReftSnapshotter:
    """Takes, protects and commits the snapshots of one rank, on the schedule of
    ``--reft-schedule``: ``end-of-iteration`` (blocking copy after the optimizer step),
    ``host-thread`` (a thread copies it all at once, unaware of the schedule) or ``has``
    (bubbles first, the rest in small chunks beside compute; see reft_ext/save/has.py)."""

    def __init__(self, cfg: ReftConfig, adapter: StateAdapter,
                 events: PipelineEvents | None = None):
        self.cfg, self.a = cfg, adapter
        cfg.validate_layout(adapter.world_size, adapter.all_dp_groups)
        self.D = len(adapter.dp_ranks)
        self.member = adapter.dp_ranks.index(adapter.rank)
        self.protection = make_protection(cfg.redundancy, self.D)
        self.layout = StateLayout(adapter.replicated_tensors(), adapter.owned_tensors(),
                                  self.D, self.member, self.protection.sub_blocks())
        self.store = SnapshotStore(cfg.job_id, cfg.node_of(adapter.rank), adapter.rank,
                                   cfg.shm_dir, slots=cfg.keep)
        node, rpn = cfg.node_of(adapter.rank), cfg.ranks_per_node
        # REFT's state signals (HEALTHY, SNAP, COMPLETED ...), written by the node's first rank
        self.signals = node_status.NodeSignals(cfg.shm_dir, cfg.job_id, node,
                                               list(range(node * rpn, (node + 1) * rpn)),
                                               adapter.rank % rpn == 0)
        self.aor = None  # AORTransport: this rank's shard -> its holder, a peer's replica here
        aor_bytes = self._setup_aor() if cfg.enabled and cfg.aor else 0
        self.regions = snapshot_regions(self.layout, self.protection, aor_bytes)
        self.nbytes = sum(n for _, n in self.regions.values())
        self.aor_checks = [0, 0]  # verifications, mismatches
        # the run's identity in every manifest: REFT-load never takes another run's state
        ident = getattr(adapter, "identity", None)
        self.identity = stamp(ident()) if ident is not None else None
        self.engine = CopyEngine()
        # snapshot units: one native thread (a unit is one 4 MiB chunk), CPU sources only
        cpu = all(t.device.type == "cpu" for t in
                  self.layout.replicated.tensors + self.layout.owned.tensors)
        self.unit_engine = CopyEngine(1) if _native.C is not None and cpu else None
        # test hook: called halfway through a snapshot write (after the own slice)
        self.fault: Callable[[int], None] | None = None
        self._check_memory()
        self.events = events or PipelineEvents(adapter.rank)
        self.pipeline = getattr(adapter, "pipeline", (1, 1, 1))  # (pp, vpp, micro-batches)
        self.pending: Batch | None = None
        self.last: dict = {}
        self.blocked_history: list[float] = []  # slowest rank's blocking s, per snapshot
        self.recovered_from: str | None = None  # set by REFT-load (reft_ext/load/recover.py)
        # BW_io of Algorithm 1, bytes/s, as measured by the last snapshots (None before
        # the first: it then waits for the bubbles and the step, never competing)
        self.bandwidth: float | None = None
        self._bw: list[float] = []
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # sharing these cores
        self.concurrent_tier2 = _concurrent_tier2(cfg, self.layout, local_ranks)
        self.worker = None
        if cfg.enabled and cfg.schedule != "end-of-iteration":
            self.worker = HasWorker(self.events.trace)
            if cfg.schedule == "has":
                self.events.listeners.append(self.worker)

    def _setup_aor(self) -> int:
        """AOR: a dedicated gloo group per sharding group, the owner's step hook, and the
        live replica of member (d+1)'s shard in this failure domain's shared memory.
        Returns the replica's size (the "aor" region of every snapshot)."""
        from reft_ext.protect.aor.transport import AORTransport, new_aor_group

        group = new_aor_group(self.a.dp_ranks)
        self.aor = AORTransport(self.a.torch_optimizers(), group,
                                alloc=lambda n: self.store.buffer("aor", n))
        specs = [None] * self.D
        torch.distributed.all_gather_object(specs, self.aor.owner.spec, group=group)
        self.aor_peer_spec = specs[self.aor.ranks.index(self.aor.owner_rank)]
        return self.aor_peer_spec.nbytes

    def start(self) -> None:
        """Before the first step (after any recovery): holders get their owners' shards."""
        if self.aor is not None:
            self.aor.initialize()

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
        return (self.cfg.keep * self.nbytes + self.regions["aor"][1]) * self.cfg.ranks_per_node

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
        # both slots are created (space checked and reserved) now, not at the first
        # snapshot: too little /dev/shm is a clear error before any work is done
        self.store.reserve(self.nbytes)

    # ---- save -------------------------------------------------------------------
    def maybe_snapshot(self, iteration: int) -> bool:
        """Called after the optimizer step of ``iteration``."""
        if not self.cfg.enabled or iteration % self.cfg.snapshot_every:
            return False
        self.flush()
        if self.worker is None:       # end-of-iteration: copy now, training waits
            with self.events.span("snapshot-copy", "snapshot", iteration=iteration):
                self._run_inline(self._begin(iteration))
            self._finish(wait_s=None)
        else:                         # has / host-thread: copy during the next fwd/bwd
            with self.events.span("snapshot-handover", "snapshot", iteration=iteration):
                batch = self._begin(iteration)
                self._plan_tiers(batch)
                self.worker.submit(batch)
        return True

    def before_optimizer_step(self) -> None:
        """The state is about to change: the snapshot in flight must be complete."""
        self.flush()

    def flush(self) -> None:
        """Finish and commit the snapshot in flight, if any (also at exit)."""
        if self.pending is None:
            return
        with self.events.span("snapshot-drain", "snapshot", iteration=self.pending.iteration):
            wait = self.worker.drain()
        self._finish(wait_s=wait)

    def _begin(self, iteration: int) -> Batch:
        """Units of work for the state as it is now, metadata captured now."""
        lay, units = self.layout, []
        self.signals.set(node_status.SNAP, detail=f"snapshot of iteration {iteration}")
        slot, buf = self.store.begin(self.nbytes)
        start = lay.slice_range(self.member)[0]
        fills = {
            "own": lambda dst, lo: self._copy(lay.replicated, start + lo, dst),
            "redundancy": lambda dst, lo: self.protection.encode(lay, dst, lo),
            "owned": lambda dst, lo: self._copy(lay.owned, lo, dst),
            "aor": self._copy_aor,
        }
        batch = Batch(units, iteration)
        for region, (off, n) in self.regions.items():
            for index, lo in enumerate(range(0, n, CHUNK)):
                dst = buf[off + lo:off + min(n, lo + CHUNK)]
                units.append(Unit(region, index, dst.numel(),
                                  self._unit(batch, fills[region], dst, lo, region)))
        self.pending = batch
        batch.slot, batch.t0 = slot, time.perf_counter()
        batch.meta = to_jsonable(self.a.get_meta())
        return batch

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

    def _copy_aor(self, dst: torch.Tensor, lo: int) -> None:
        self.aor.wait()  # the replica has applied the step this snapshot is of
        dst.copy_(self.aor.replica.buffer[lo:lo + dst.numel()])

    def _unit(self, batch, fill, dst, lo, region):
        def run() -> int:
            if region != "own" and self.fault is not None and not batch.fault_checked:
                batch.fault_checked = True  # test hook: "halfway through the write"
                self.fault(batch.iteration)
            with torch.no_grad():
                fill(dst, lo)
            return chunk_digest(dst)
        return run

    def _run_inline(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        for u in batch.units:
            batch.digests.setdefault(u.region, {})[u.index] = u.run()
        batch.done = len(batch.units)
        batch.by_how["drain"] = self.nbytes
        batch.busy_s = time.perf_counter() - t0

    def _plan_tiers(self, batch: Batch) -> None:
        """Algorithm 1 with measured inputs. T_bubble is the larger of the 1F1B formula
        (P-1) * t_fb, t_fb measured from this stage's compute phases, and the profile of
        the p2p waits of recent steps: the waits see the warm-up/steady-state bubbles
        (and any imbalance), the formula also counts the cool-down idle of the later
        stages, which falls after their last backward, where the drain copies."""
        t_snap = snapshot_time(self.nbytes, self.bandwidth) if self.bandwidth else float("inf")
        prof = self.events.profile
        compute, (pp, vpp, m) = prof.compute(), self.pipeline
        formula = bubble_time(pp, compute / m, vpp) if compute else 0.0
        t_bubble = max(formula, prof.bubble() or 0.0)
        if self.cfg.schedule == "host-thread":
            t_bubble = 0.0
        split = tier_split(self.nbytes, t_snap, t_bubble)
        if self.bandwidth is None and t_bubble > 0:  # first snapshot: bubbles only
            split = tier_split(self.nbytes, 0.0, t_bubble)
        batch.split, seen = split, 0
        host_thread = self.cfg.schedule == "host-thread"  # copies at once, everything
        for u in batch.units:
            # deferred tier 2 waits, like tier 1, for a bubble or the drain
            bubble = seen < split.bubble_bytes or not self.concurrent_tier2
            u.tier = TIER2 if host_thread or not bubble else TIER1
            seen += u.nbytes

    def _finish(self, wait_s: float | None) -> None:
        batch, self.pending = self.pending, None
        algo, sums = CHECKSUM, {}
        for region, (_, n) in self.regions.items():
            d = batch.digests.get(region, {})
            sums[region] = combine([d[i] for i in range(len(d))], algo) if n else \
                checksum(b"", algo)
        if batch.busy_s > 0 and self.nbytes >= CHUNK:  # bytes/s of the copy + hash itself
            self._bw = [*self._bw[-2:], self.nbytes / batch.busy_s]
            self.bandwidth = sorted(self._bw)[len(self._bw) // 2]
        manifest = {
            "iteration": batch.iteration, "rank": self.a.rank, "member": self.member,
            "dp_ranks": self.a.dp_ranks, "world_size": self.a.world_size,
            "protection": self.protection.name, "layout": self.layout.signature(),
            "nbytes": self.nbytes, "checksum": algo,
            "regions": {k: [o, n, sums[k]] for k, (o, n) in self.regions.items()},
            "meta": batch.meta,
        }
        if self.identity is not None:  # + the run id (kept in the state across restarts)
            run_id = getattr(self.a, "run_id", None)
            manifest["identity"] = dict(self.identity, run=run_id() if run_id else None)
        if self.aor is not None:  # whose shard the aor region holds, and can it be trusted
            manifest["aor"] = {"owner": self.aor.owner_rank, "valid": self.aor.replica.valid}
        self.store.finish(batch.slot, manifest)
        blocked = batch.busy_s if wait_s is None else wait_s
        with self.events.span("snapshot-commit", "snapshot", iteration=batch.iteration):
            # collective commit: the new snapshot replaces the old one only when it is
            # complete on every rank of the job (the all-reduce returns only then)
            total = torch.tensor([self.nbytes], dtype=torch.int64)
            torch.distributed.all_reduce(total, group=self.a.control_group)
            self.store.commit(batch.slot, batch.iteration)
        self.signals.set(node_status.COMPLETED, batch.iteration)
        self.last = {"iteration": batch.iteration, "blocked_s": blocked, **batch.by_how,
                     "sums": sums}
        stats = torch.tensor([blocked, batch.busy_s], dtype=torch.float64)
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX,
                                     group=self.a.control_group)
        self.blocked_history.append(stats[0].item())
        if self.a.rank == 0:
            r, how = self.regions, batch.by_how
            aor = f", aor {r['aor'][1]}" if self.aor is not None else ""
            tiers = "" if wait_s is None else (
                f", {self.cfg.schedule}: {how['bubble']} B in bubbles, {how['compute']} B "
                f"beside compute, {how['drain']} B at the step")
            reft_print(f"snapshot iteration {batch.iteration}: {total.item()} bytes on "
                       f"{self.a.world_size} ranks (per rank: own {r['own'][1]}, "
                       f"{self.protection.name} {r['redundancy'][1]}, owned {r['owned'][1]}"
                       f"{aor})"
                       f"{tiers}; training blocked {1000 * stats[0].item():.1f} ms, copy "
                       f"{1000 * stats[1].item():.1f} ms (slowest rank), committed "
                       f"{1000 * (time.perf_counter() - batch.t0):.1f} ms after the step")

    def close(self, remove: bool) -> None:
        self.flush()
        if self.aor is not None:
            self.aor.close()
        if self.unit_engine is not None:
            self.unit_engine.close()
        if self.worker is not None:
            self.worker.close()
        self.engine.close()
        if remove:
            self.store.remove()
        else:
            self.store.close()
