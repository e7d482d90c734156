"""REFT-load: after a restart, find the newest iteration the job can rebuild from host
memory, agree on it, and restore it; otherwise say why and let the caller fall back to
the persistent checkpoint.

1. Each rank verifies (CRC) the regions of every snapshot slot in its failure domain and
   reports what it holds; the reports are all-gathered.
2. Every rank runs the same deterministic plan: for each candidate iteration (newest
   first), each sharding group must be able to produce every slice (own memory, an ARC
   replica or AEC parity) and every rank its owned (ZeRO-1) state. A newer persistent
   checkpoint wins.
3. Groups all-gather their own slices, rebuild the lost ones from redundancy blocks
   broadcast by their holders, and write the full replicated state back into the model;
   owned state and metadata (RNG, counters, scheduler) come from the rank's own snapshot,
   or for a replaced rank from a surviving group member (DP replicas share them).
"""

from __future__ import annotations

import time

import torch

from reft_ext.protection import OWN
from reft_ext.snapshot import ReftSnapshotter, reft_print
from reft_ext.store import from_jsonable


def _inventory(s: ReftSnapshotter) -> dict:
    """iteration -> {slot, own, redundancy, owned} validity for this rank."""
    out = {}
    sig = s.layout.signature()
    for slot, m in s.store.manifests().items():
        usable = (m.get("layout") == sig and m.get("nbytes") == s.nbytes and
                  m.get("protection") == s.protection.name)
        flags = {r: usable and s.store.verify(slot, m, r) for r in ("own", "redundancy",
                                                                      "owned")}
        it = int(m["iteration"])
        if it not in out or sum(flags.values()) > sum(out[it]["ok"].values()):
            out[it] = {"slot": slot, "ok": flags}
    return out


def plan_recovery(s: ReftSnapshotter, inventories: list[dict], persistent: int | None):
    """(iteration, {group index: plan}) or (None, reason). Same answer on every rank."""
    groups = s.a.all_dp_groups
    owned_needed = s.layout.owned.nbytes > 0
    candidates = sorted({it for inv in inventories for it in inv}, reverse=True)
    reasons = []
    for it in candidates:
        plans, why = {}, None
        for gi, ranks in enumerate(groups):
            own_ok = [inventories[r].get(it, {}).get("ok", {}).get("own", False) for r in ranks]
            red_ok = [inventories[r].get(it, {}).get("ok", {}).get("redundancy", False)
                      for r in ranks]
            plan = s.protection.plan(own_ok, red_ok)
            if plan is None:
                lost = [r for r, ok in zip(ranks, own_ok) if not ok]
                why = (f"sharding group {ranks} lost the slices of ranks {lost}, more than "
                       f"--reft-protect {s.protection.name} can rebuild")
                break
            if owned_needed:
                lost = [r for r in ranks
                        if not inventories[r].get(it, {}).get("ok", {}).get("owned", False)]
                if lost:
                    why = (f"ranks {lost} lost their ZeRO-1 optimizer shards (no host "
                           f"replica without --reft-protect aor)")
                    break
            plans[gi] = plan
        if why is None:
            if persistent is not None and persistent > it:
                return None, (f"the persistent checkpoint (iteration {persistent}) is newer "
                              f"than host memory (iteration {it})")
            return it, plans
        reasons.append(f"iteration {it}: {why}")
    if not candidates:
        return None, "no snapshot in host memory"
    return None, "; ".join(reasons[:2])


@torch.no_grad()
def recover(s: ReftSnapshotter, persistent: int | None) -> int | None:
    """Restore from host memory; returns the iteration, or None (caller falls back)."""
    t0 = time.perf_counter()
    a = s.a
    mine = _inventory(s)
    inventories = [None] * a.world_size
    torch.distributed.all_gather_object(inventories, mine, group=a.control_group)
    it, plans = plan_recovery(s, inventories, persistent)
    if it is None:
        if a.rank == 0:
            reft_print(f"recovery from host memory not possible: {plans}")
        return None
    gi = a.all_dp_groups.index(a.dp_ranks)
    plan = plans[gi]
    lay, L = s.layout, s.layout.slice_bytes
    entry = mine.get(it)
    manifest = s.store.manifests()[entry["slot"]] if entry else None
    data = s.store.data(entry["slot"], s.nbytes) if entry else None
    # 1. own slices, all-gathered in the group
    own = torch.zeros(L, dtype=torch.uint8)
    if plan[s.member] == OWN:
        off, n = s.regions["own"]
        own.copy_(data[off:off + n])
    slices = [torch.empty(L, dtype=torch.uint8) for _ in range(s.D)]
    torch.distributed.all_gather(slices, own, group=a.dp_group)
    # 2. lost slices rebuilt from the redundancy blocks of their holders
    for lost in sorted(d for d, how in plan.items() if how != OWN):
        redundancy = {}
        for m in s.protection.sources(lost):
            block = torch.empty(s.red_bytes, dtype=torch.uint8)
            if m == s.member:
                off, n = s.regions["redundancy"]
                block.copy_(data[off:off + n])
            torch.distributed.broadcast(block, src=a.dp_ranks[m], group=a.dp_group)
            redundancy[m] = block
        s.protection.recover(lost, {d: t for d, t in enumerate(slices)}, redundancy,
                             slices[lost])
    # 3. write the replicated state back, then owned state and metadata
    for d in range(s.D):
        lay.replicated.write(d * L, slices[d])
    sources = [plan[d] for d in range(s.D)]
    meta_src = min(d for d in range(s.D) if plan[d] == OWN)
    if any(how != OWN for how in sources):
        obj = [manifest["meta"] if plan[s.member] == OWN else None]
        torch.distributed.broadcast_object_list(obj, src=a.dp_ranks[meta_src], group=a.dp_group)
        meta = manifest["meta"] if plan[s.member] == OWN else obj[0]
    else:
        meta = manifest["meta"]
    if lay.owned.nbytes:
        off, n = s.regions["owned"]
        lay.owned.write(0, data[off:off + n])
    a.set_meta(from_jsonable(meta))
    ms = 1000 * (time.perf_counter() - t0)
    how = {"own": "own memory", "replica": "ARC replica", "parity": "AEC parity"}
    stats = torch.tensor([ms], dtype=torch.float64)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=a.control_group)
    lost = sum(1 for d in sources if d != OWN)
    reft_print(f"recovered iteration {it} on rank {a.rank} from {how[plan[s.member]]} "
               f"(group {a.dp_ranks}: {lost} slice(s) rebuilt) in {stats.item():.1f} ms")
    return it
