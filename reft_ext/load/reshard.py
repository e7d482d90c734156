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

import glob
import json
import os
import re
import socket
import time

import torch

from reft_ext.save.snapshotter import reft_print
from reft_ext.store.slots import SnapshotStore, from_jsonable


def _key() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    return f"{host}-{os.getppid()}-{os.environ.get('LOCAL_RANK', '0')}"


def write_handover(shm_dir: str, job: str, rank: int, node: int, world_size: int) -> str:
    """This rank's place in the job it is leaving (next to the old node's directory, so
    the launcher's clean-up of ``reft-<job>-node*`` removes a stale note too)."""
    path = os.path.join(shm_dir, f"reft-{job}-node{node}.handover-{_key()}.json")
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"rank": rank, "node": node, "world_size": world_size}, f)
    os.replace(tmp, path)
    return path


def take_handover(shm_dir: str, job: str) -> dict | None:
    """This rank's note from the attempt before, removed: a later restart of the same
    agent must not take it for a fresh one."""
    found = None
    for p in glob.glob(os.path.join(shm_dir, f"reft-{glob.escape(job)}-node*.handover-"
                                             f"{glob.escape(_key())}.json")):
        try:
            with open(p) as f:
                found = json.load(f)
        except (OSError, ValueError):
            pass
        os.unlink(p)
    return found


def _offer(s, note: dict) -> tuple[dict, SnapshotStore]:
    """Which old slices this rank holds (verified), per iteration of the old job."""
    store = SnapshotStore(s.cfg.job_id, note["node"], note["rank"], s.cfg.shm_dir)
    want = s.layout.signature()["replicated"]
    iters, why = {}, ""
    for slot, m in store.manifests().items():
        sig = m.get("layout", {})
        if m.get("world_size") != note["world_size"] or m.get("rank") != note["rank"]:
            continue
        if sig.get("replicated") != want:
            why = "the replicated state (params, optimizer) differs from the snapshot's"
            continue
        if sig.get("owned", [0, 0])[1] or s.layout.owned.nbytes:
            why = "ZeRO-1 optimizer shards (--use-distributed-optimizer) are cut for the old " \
                  "data-parallel size"
            continue
        D, member, prot = sig["group_size"], m["member"], m.get("protection")
        have = {}
        if store.verify(slot, m, "own"):
            have[member] = "own"
        # an AEC parity block of a group of 2 is the other member's slice
        if (prot == "arc" or (prot == "aec" and D == 2)) and D > 1 and \
                store.verify(slot, m, "redundancy"):
            have[(member + 1) % D] = "redundancy"
        iters[int(m["iteration"])] = {"slot": slot, "old_group": m["dp_ranks"], "D": D,
                                      "slice": sig["slice_bytes"], "have": have,
                                      "protection": prot}
    return {"old_rank": note["rank"], "iters": iters, "why": why}, store


def plan_reshard(offers: list, groups: list[list[int]], persistent: int | None):
    """(iteration, {new group index: [provider rank of each old slice]}) or (None, why).
    Same answer on every rank."""
    if any(o is None for o in offers):
        missing = [r for r, o in enumerate(offers) if o is None]
        return None, f"ranks {missing} have no note of their place in the old job"
    common = set.intersection(*[set(o["iters"]) for o in offers])
    if not common:
        why = next((o["why"] for o in offers if o["why"]), "")
        return None, why or "the survivors hold no common iteration of the old job"
    reasons = []
    for it in sorted(common, reverse=True):
        plans, why = {}, None
        for gi, ranks in enumerate(groups):
            e = [offers[r]["iters"][it] for r in ranks]
            if len({tuple(x["old_group"]) for x in e}) != 1:
                why = f"ranks {ranks} come from different sharding groups of the old job"
                break
            D = e[0]["D"]
            providers = [next((r for r, x in zip(ranks, e) if j in x["have"]), None)
                         for j in range(D)]
            lost = [e[0]["old_group"][j] for j, p in enumerate(providers) if p is None]
            if lost:
                why = (f"the slices of old ranks {lost} (sharding group {e[0]['old_group']}) "
                       f"left with the excluded node(s) and no survivor holds a copy "
                       f"(--reft-protect {e[0]['protection']})")
                break
            plans[gi] = providers
        if why is None:
            if persistent is not None and persistent > it:
                return None, (f"the persistent checkpoint (iteration {persistent}) is newer "
                              f"than host memory (iteration {it})")
            return it, plans
        reasons.append(f"iteration {it}: {why}")
    return None, "; ".join(reasons[:2])


@torch.no_grad()
def reshard_from_memory(s, persistent: int | None) -> int | None:
    """Collective. None (and nothing done) when no rank has a handover note, i.e. the job
    did not just shrink; None with a logged reason when memory cannot serve it."""
    a = s.a
    note = take_handover(s.cfg.shm_dir, s.cfg.job_id)
    offer, store = _offer(s, note) if note else (None, None)
    t0 = time.perf_counter()
    offers = [None] * a.world_size
    torch.distributed.all_gather_object(offers, offer, group=a.control_group)
    if all(o is None for o in offers):
        return None
    it, plans = plan_reshard(offers, a.all_dp_groups, persistent)
    if it is None:
        if a.rank == 0:
            reft_print(f"resharding from host memory after the shrink not possible: {plans}")
        return None
    providers = plans[a.all_dp_groups.index(a.dp_ranks)]
    mine = offer["iters"][it]
    manifest = store.manifests()[mine["slot"]]
    data = store.data(mine["slot"], manifest["nbytes"])
    L = mine["slice"]
    for j, src in enumerate(providers):  # every member ends with every old slice
        if src == a.rank:
            off = manifest["regions"][mine["have"][j]][0]
            buf = data[off:off + L].clone()
        else:
            buf = torch.empty(L, dtype=torch.uint8)
        torch.distributed.broadcast(buf, src=src, group=a.dp_group)
        s.layout.replicated.write(j * L, buf)
    a.set_meta(from_jsonable(manifest["meta"]))
    store.close()
    ms = torch.tensor([1000 * (time.perf_counter() - t0)], dtype=torch.float64)
    torch.distributed.all_reduce(ms, op=torch.distributed.ReduceOp.MAX, group=a.control_group)
    reft_print(f"resharded iteration {it} from host memory on rank {a.rank} (rank "
               f"{offer['old_rank']} of the old job, sharding group {mine['old_group']} -> "
               f"{a.dp_ranks}: {len(providers)} old slices from ranks {providers}) in "
               f"{ms.item():.1f} ms")
    return it
