"""How a written slot becomes a restorable snapshot: its manifest is sealed on this rank,
then the whole job commits it together.

1. :meth:`Committer.seal`: the regions' checksums (combined from the chunk digests the
   snapshot units computed while copying) and the manifest (what REFT-load restores
   besides the bytes: layout, protection, metadata, identity, AOR owner) are written
   into the slot, atomically (reft_ext/store/slots.py ``finish``). The slot is complete
   on this rank.
2. :meth:`Committer.commit`: an all-reduce over the job; it returns only when every rank
   has sealed this iteration, and only then does each rank move its commit pointer. A
   crash before that leaves the previous commit in place on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from reft_ext.store.checksum import DEFAULT, checksum, combine
from reft_ext.store.slots import SnapshotStore
from reft_ext.testing import fault_point  # the one test injection point (no-op in production)


def region_checksums(regions: dict, digests: dict, algorithm: str = DEFAULT) -> dict:
    """region -> checksum, from each region's chunk digests in chunk order (an empty
    region: the checksum of no bytes)."""
    sums = {}
    for region, (_, n) in regions.items():
        d = digests.get(region, {})
        sums[region] = combine([d[i] for i in range(len(d))], algorithm) if n else \
            checksum(b"", algorithm)
    return sums


class Committer:
    """One rank's manifests and commits. ``header``: the manifest fields that are the
    same for every snapshot of this run (rank, member, group, protection, layout,
    nbytes); ``identity``: the run's stamp (reft_ext/state/identity.py), completed by
    ``run_id()`` at every snapshot; ``aor``: the rank's AOR transport, if any."""

    def __init__(self, store: SnapshotStore, header: dict, regions: dict, group,
                 identity: dict | None = None, run_id: Callable[[], str] | None = None,
                 aor=None, algorithm: str = DEFAULT):
        self.store, self.header, self.regions, self.group = store, header, regions, group
        self.identity, self.run_id, self.aor = identity, run_id, aor
        self.algorithm = algorithm

    def manifest(self, iteration: int, sums: dict, meta) -> dict:
        m = {"iteration": iteration, **self.header, "checksum": self.algorithm,
             "regions": {k: [o, n, sums[k]] for k, (o, n) in self.regions.items()},
             "meta": meta}
        if self.identity is not None:  # + the run id (kept in the state across restarts)
            m["identity"] = dict(self.identity, run=self.run_id() if self.run_id else None)
        if self.aor is not None:  # whose shard the aor region holds, and can it be trusted
            m["aor"] = {"owner": self.aor.owner_rank, "valid": self.aor.replica.valid}
        return m

    def seal(self, slot: int, iteration: int, digests: dict, meta) -> dict:
        """Write the slot's manifest: complete on this rank. Returns the regions' sums."""
        sums = region_checksums(self.regions, digests, self.algorithm)
        self.store.finish(slot, self.manifest(iteration, sums, meta))
        return sums

    def commit(self, slot: int, iteration: int, nbytes: int) -> int:
        """Collective: the new snapshot replaces the old one only when it is complete on
        every rank of the job (the all-reduce returns only then). Returns the job's
        snapshot bytes."""
        total = torch.tensor([nbytes], dtype=torch.int64)
        torch.distributed.all_reduce(total, group=self.group)
        # every rank has sealed the iteration; a kill here leaves some commit pointers
        # moved and others not (REFT-load takes the job-wide newest: every rank holds it)
        fault_point("commit", iteration=iteration, slot=slot)
        self.store.commit(slot, iteration)
        return int(total.item())
