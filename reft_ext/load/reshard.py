"""REFT-load after an elastic shrink: the replicated state comes back from the survivors'
host memory, although the snapshots are cut for the old data-parallel size.

A shrink (docs/nodes.md) drops whole nodes, so each sharding group of the smaller job is
what is left of one sharding group of the old job: D_old slices, of which the survivors
hold their own and (ARC) their replica of the next member's. If every slice of the old
group is still held by some survivor, each survivor broadcasts what it holds to the new
group, every member writes the whole replicated stream into its model (it is a replica of
it: params and Adam state), and takes the metadata of its own old snapshot. Not covered
(the caller falls back to the persistent checkpoint, which megatron-core reshards): ZeRO-1
shards (owned state: their bucket layout depends on the DP size), AEC with D_old > 2
(decoding needs parity blocks of lost members' peers), protection none.

Who was who: the rendezvous may renumber the surviving nodes (and on one host several
nodes' shared memory is visible), so before leaving the failed attempt each healthy rank
writes a handover note, keyed by the one thing that outlives the restart: its torchrun
agent (host, pid) and local rank. The next attempt reads and removes it.
"""

from __future__ import annotations

import time

import torch

# the note's format is the writer's (the leaving job's code, a layer below this one)
from reft_ext.cluster.shrink import take_handover, write_handover
from reft_ext.load.errors import RecoveryError
from reft_ext.load.inventory import Offer, take_offer
from reft_ext.load.planning import plan_reshard
from reft_ext.load.received import Received, outgoing
from reft_ext.load.view import SnapshotView
from reft_ext.report.events import reft_print
from reft_ext.store.slots import SnapshotStore, from_jsonable

__all__ = ["write_handover", "take_handover", "plan_reshard", "reshard_from_memory"]


def _offer(v: SnapshotView, note: dict) -> tuple[Offer, SnapshotStore]:
    """Which old slices this rank holds (verified), per iteration of the old job."""
    store = SnapshotStore(v.job_id, note["node"], note["rank"], v.shm_dir)
    return take_offer(store.manifests(), note, v.layout.signature()["replicated"],
                      v.layout.owned.nbytes, store.verify), store


@torch.no_grad()
def reshard_from_memory(s, persistent: int | None, direct: bool = True) -> int | None:
    """Collective. None (and nothing done) when no rank has a handover note, i.e. the job
    did not just shrink; None with a logged reason (a RecoveryError, or a slice received
    from a peer that failed its checksum) when memory cannot serve it.

    ``direct``: each slice goes into the model as it arrives, and one that then fails its
    checksum is overwritten by the persistent checkpoint the caller falls back to. Without
    a full persistent load to follow (``persistent`` None, or ``direct`` False: e.g.
    --no-load-optim) the slices are held until every rank checked its own."""
    v = SnapshotView.of(s)
    note = take_handover(v.shm_dir, v.job_id)
    offer, store = _offer(v, note) if note else (None, None)
    t0 = time.perf_counter()
    offers = [None] * v.world_size
    torch.distributed.all_gather_object(offers, offer, group=v.control_group)
    if all(o is None for o in offers):
        return None
    try:
        it, plans = plan_reshard(offers, v.groups, persistent)
    except RecoveryError as why:
        if v.rank == 0:
            reft_print(f"resharding from host memory after the shrink not possible: {why}",
                       event="reshard_impossible", reason=str(why))
        return None
    providers = plans[v.group_index]
    mine = offer.iters[it]
    manifest = store.manifests()[mine.slot]
    data = store.data(mine.slot, manifest["nbytes"])
    L, rx = mine.slice, Received(v.rank, it, [{it: o.iters.get(it)} if o else {}
                                               for o in offers])
    held, direct = {}, direct and persistent is not None
    for j, src in enumerate(providers):  # every member ends with every old slice
        if src == v.rank:
            off = manifest["regions"][mine.have[j]][0]
            buf = outgoing(data[off:off + L].clone(), it, f"old slice {j}", -1)
        else:
            buf = torch.empty(L, dtype=torch.uint8)
        torch.distributed.broadcast(buf, src=src, group=v.dp_group)
        if src != v.rank:
            rx.check(buf, f"old slice {j}", src, src, j)
        if direct:
            v.layout.replicated.write(j * L, buf)
        else:
            held[j] = buf
    if not rx.agree(v.control_group):
        store.close()
        if v.rank == 0:
            reft_print("resharding from host memory after the shrink refused: slices "
                       "received from peers failed their checksums (the lines above)",
                       event="reshard_impossible", reason="received data failed its checksum")
        return None
    for j, buf in held.items():
        v.layout.replicated.write(j * L, buf)
    v.set_meta(from_jsonable(manifest["meta"]))
    store.close()
    ms = torch.tensor([1000 * (time.perf_counter() - t0)], dtype=torch.float64)
    torch.distributed.all_reduce(ms, op=torch.distributed.ReduceOp.MAX, group=v.control_group)
    reft_print(f"resharded iteration {it} from host memory on rank {v.rank} (rank "
               f"{offer.old_rank} of the old job, sharding group {mine.old_group} -> "
               f"{v.dp_ranks}: {len(providers)} old slices from ranks {providers}) in "
               f"{ms.item():.1f} ms", event="resharded", iteration=it, rank=v.rank,
               old_rank=offer.old_rank, old_group=mine.old_group,
               group=list(v.dp_ranks), providers=providers, ms=ms.item())
    return it
