"""How a written slot becomes a restorable snapshot: its manifest is sealed on this rank,
then its commit pointer moves.

1. :meth:`Committer.seal`: the regions' checksums (combined from the chunk digests the
   snapshot units computed while copying) and the manifest (what REFT-load restores
   besides the bytes: layout, protection, metadata, identity, AOR owner) are written
   into the slot, atomically (reft_ext/store/slots.py ``finish``). The slot is complete
   on this rank.
2. :meth:`Committer.commit`: the commit pointer moves to it. Two ways:

   * **local** (``--reft-keep`` >= 3; automatic above 16 nodes): no collective.
     Snapshot k is sealed in ``before_optimizer_step(k+1)``, and before any rank's
     optimizer step of k+1 it has heard, through messages each sent after its sender's
     step k, from every rank: the pipeline's forward and backward p2p cross every
     stage, the tensor-parallel all-reduces every rank of a stage, the gradient
     reduction every data-parallel replica. So when a rank seals k, every rank has
     sealed k-1; pointers differ by at most one iteration, and a rank that begins
     snapshot k+1 (after its step k+1) overwrites k-2, which no rank needs: REFT-load
     takes the *oldest* pointer, which every rank still holds (the ring keeps k-1 and
     k). The argument needs the training's own communication to connect every rank
     within an iteration: true of every Megatron layout (a data-parallel-only job
     through its gradient reduction).
   * **job-wide** (``--reft-keep 2``; automatic up to 16 nodes, where it costs little
     and keeps which iteration a failure recovers independent of timing): an
     all-reduce over the job; it returns only when every rank has sealed this
     iteration, and only then does each rank move its pointer. REFT-load takes the
     newest pointer (every rank has sealed it). One collective of the whole job per
     snapshot: what local commits remove (docs/scale.md). Under a threaded schedule the
     snapshot thread seals and posts it as soon as the last chunk is copied
     (reft_ext/save/early_seal.py); the pointer still moves at the step.
"""

from __future__ import annotations

from typing import Callable

import torch

from reft_ext.store.checksum import DEFAULT, checksum, combine
from reft_ext.store.slots import SnapshotStore, to_jsonable
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
    ``run_id()`` at every snapshot; ``aor``: the rank's AOR transport, if any; ``local``:
    commits without a collective (``group`` is then unused)."""

    def __init__(self, store: SnapshotStore, header: dict, regions: dict, group,
                 identity: dict | None = None, run_id: Callable[[], str] | None = None,
                 aor=None, algorithm: str = DEFAULT, local: bool = True):
        self.store, self.header, self.regions, self.group = store, header, regions, group
        self.local = local
        self.identity, self.run_id, self.aor = identity, run_id, aor
        self.algorithm = algorithm

    def manifest(self, iteration: int, sums: dict, meta) -> dict:
        m = {"iteration": iteration, **self.header, "checksum": self.algorithm,
             "regions": {k: [o, n, sums[k]] for k, (o, n) in self.regions.items()},
             "meta": meta}
        if self.identity is not None:  # + the run id (kept in the state across restarts)
            m["identity"] = dict(self.identity, run=self.run_id() if self.run_id else None)
        if self.aor is not None:  # whose shard the aor region holds, and can it be trusted
            # exact: the owner's bytes (a bit-identical replay, or a GPU/fused owner's at
            # the step of its last verification); else its CPU replay since that step
            m["aor"] = {"owner": self.aor.owner_rank, "valid": self.aor.replica.valid,
                        "exact": self.aor.exact(), "exact_step": self.aor.exact_step}
        return m

    def seal(self, slot: int, iteration: int, digests: dict, meta) -> dict:
        """Write the slot's manifest: complete on this rank. Returns the regions' sums.
        ``meta``: the trainer's metadata as captured (made JSON here)."""
        sums = region_checksums(self.regions, digests, self.algorithm)
        self.store.finish(slot, self.manifest(iteration, sums, to_jsonable(meta)))
        return sums

    def commit(self, slot: int, iteration: int, agreement=None) -> None:
        """The new snapshot becomes this rank's commit. Job-wide commits first wait for
        every rank of the job to have sealed it (the all-reduce returns only then);
        ``agreement``: that all-reduce, posted already by the snapshot thread when it
        sealed the slot (reft_ext/save/early_seal.py)."""
        if not self.local:
            if agreement is not None:
                agreement.wait()
            else:
                torch.distributed.all_reduce(torch.zeros(1, dtype=torch.int64),
                                             group=self.group)
        # (tests) sealed, pointer not moved. Job-wide: every rank has sealed the
        # iteration, some pointers moved and others not (REFT-load takes the newest:
        # every rank holds it). Local: this rank's pointer lags (REFT-load takes the
        # oldest: every rank holds it)
        fault_point("commit", iteration=iteration, slot=slot)
        self.store.commit(slot, iteration)
