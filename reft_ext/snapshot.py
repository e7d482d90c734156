"""REFT-save: per-iteration sharded snapshots into host memory, protected, committed
job-wide. The trainer supplies a :class:`StateAdapter`; this module never imports the
training loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import torch

from reft_ext.checksum import DEFAULT as CHECKSUM
from reft_ext.checksum import checksum
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.copy_engine import CopyEngine
from reft_ext.layout import StateLayout
from reft_ext.protection import make_protection, snapshot_regions
from reft_ext.store import SnapshotStore, to_jsonable

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
    def owned_tensors(self) -> list[tuple[str, torch.Tensor]]: ...
    def get_meta(self) -> dict: ...
    def set_meta(self, meta: dict) -> None: ...


def reft_print(msg: str) -> None:
    print(f"[REFT] {msg}", flush=True)


class ReftSnapshotter:
    def __init__(self, cfg: ReftConfig, adapter: StateAdapter):
        self.cfg, self.a = cfg, adapter
        cfg.validate_layout(adapter.world_size, adapter.all_dp_groups)
        self.D = len(adapter.dp_ranks)
        self.member = adapter.dp_ranks.index(adapter.rank)
        self.protection = make_protection(cfg.redundancy, self.D)
        self.layout = StateLayout(adapter.replicated_tensors(), adapter.owned_tensors(),
                                  self.D, self.member, self.protection.sub_blocks())
        self.regions = snapshot_regions(self.layout, self.protection)
        self.nbytes = sum(n for _, n in self.regions.values())
        self.store = SnapshotStore(cfg.job_id, cfg.node_of(adapter.rank), adapter.rank,
                                   cfg.shm_dir)
        self.engine = CopyEngine()
        # test hook: called halfway through a snapshot write (after the own slice)
        self.fault: Callable[[int], None] | None = None
        self._check_memory()

    def _check_memory(self) -> None:
        """Two slots per rank, for every rank of the node: fail now, not at a SIGBUS."""
        per_node = 2 * self.nbytes * self.cfg.ranks_per_node
        limit = self.cfg.host_memory_limit_bytes
        if limit and per_node > limit:
            raise ReftConfigError(
                f"--reft-host-memory-limit: snapshots need {per_node / 2**20:.1f} MiB per node "
                f"(2 slots x {self.nbytes / 2**20:.1f} MiB x {self.cfg.ranks_per_node} ranks), "
                f"limit is {limit / 2**20:.1f} MiB; raise the limit or snapshot less state")
        # both slots are created (space checked and reserved) now, not at the first
        # snapshot: too little /dev/shm is a clear error before any work is done
        self.store.reserve(self.nbytes)

    # ---- save -------------------------------------------------------------------
    def maybe_snapshot(self, iteration: int) -> bool:
        if not self.cfg.enabled or iteration % self.cfg.snapshot_every:
            return False
        self.snapshot(iteration)
        return True

    @torch.no_grad()
    def snapshot(self, iteration: int) -> None:
        t0 = time.perf_counter()
        lay = self.layout
        slot, buf = self.store.begin(self.nbytes)
        own_off, own_n = self.regions["own"]
        start, end = lay.slice_range(self.member)
        sums = {}
        # 1. own slice, straight from the state tensors into shared memory
        pieces = lay.replicated.pieces(start, end)
        items = [(lay.replicated.tensors[p.index], buf, p.src_off, own_off + p.dst_off, p.n)
                 for p in pieces]
        covered = sum(p.n for p in pieces)
        handle = self.engine.submit(items) if items else None
        sums["own"] = lay.replicated.checksum(start, end)  # from the source bytes
        if handle is not None:
            handle.wait()
        buf[own_off + covered:own_off + own_n].zero_()
        if self.fault is not None:
            self.fault(iteration)
        # 2. redundancy, encoded from this rank's own full copy (no communication)
        r_off, r_n = self.regions["redundancy"]
        if r_n:
            red = buf[r_off:r_off + r_n]
            self.protection.encode(lay, red)
            sums["redundancy"] = checksum(red)
        else:
            sums["redundancy"] = 0
        # 3. owned state (ZeRO-1 shards), whole
        o_off, o_n = self.regions["owned"]
        items = [(lay.owned.tensors[p.index], buf, p.src_off, o_off + p.dst_off, p.n)
                 for p in lay.owned.pieces(0, lay.owned.nbytes)]
        if items:
            self.engine.submit(items).wait()
        sums["owned"] = lay.owned.checksum(0, lay.owned.nbytes)
        manifest = {
            "iteration": iteration, "rank": self.a.rank, "member": self.member,
            "dp_ranks": self.a.dp_ranks, "world_size": self.a.world_size,
            "protection": self.protection.name, "layout": lay.signature(),
            "nbytes": self.nbytes, "checksum": CHECKSUM,
            "regions": {k: [o, n, sums[k]] for k, (o, n) in self.regions.items()},
            "meta": to_jsonable(self.a.get_meta()),
        }
        self.store.finish(slot, manifest)
        t_local = time.perf_counter() - t0
        # 4. collective commit: the new snapshot replaces the old one only when it is
        #    complete on every rank of the job (the all-reduce returns only then)
        total = torch.tensor([self.nbytes], dtype=torch.int64)
        torch.distributed.all_reduce(total, group=self.a.control_group)
        self.store.commit(slot, iteration)
        slowest = torch.tensor([t_local], dtype=torch.float64)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX,
                                     group=self.a.control_group)
        if self.a.rank == 0:
            reft_print(f"snapshot iteration {iteration}: {total.item()} bytes on "
                       f"{self.a.world_size} ranks (per rank: own {own_n}, "
                       f"{self.protection.name} {r_n}, owned {o_n}) in "
                       f"{1000 * slowest.item():.1f} ms (slowest rank), committed "
                       f"{1000 * (time.perf_counter() - t0):.1f} ms")

    def close(self, remove: bool) -> None:
        self.engine.close()
        if remove:
            self.store.remove()
        else:
            self.store.close()
