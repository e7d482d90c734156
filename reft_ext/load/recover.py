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

from reft_ext import _native
from reft_ext.load.fused import load_verified
from reft_ext.protect.schemes import OWN, PARITY, REPLICA
from reft_ext.save.snapshotter import ReftSnapshotter, reft_print
from reft_ext.store.slots import from_jsonable


def _fuse(s: ReftSnapshotter, slot: int, m: dict) -> dict:
    """Round 1's reads of slot ``slot`` (own slice, ARC replica, owned state) verified
    and written into the model in one pass (reft_ext/load/fused.py): region -> whether
    its checksum matched. A failed region has left untrusted bytes in the model, which
    the restore overwrites (every slice and the owned state are written from a trusted
    source unless this slot's verified region is the one the plan restores)."""
    lay, L, D = s.layout, s.layout.slice_bytes, s.D
    targets = {"own": (lay.replicated, s.member * L), "owned": (lay.owned, 0)}
    if s.protection.name == "arc" and D > 1:
        targets["redundancy"] = (lay.replicated, ((s.member + 1) % D) * L)
    try:
        data = s.store.data(slot, m["nbytes"])
    except (OSError, ValueError):
        return dict.fromkeys(targets, False)
    # (the caller checked the slot's layout: its regions are these targets' sizes)
    jobs = [(data[m["regions"][r][0]:m["regions"][r][0] + m["regions"][r][1]],
             m["regions"][r][2], *targets[r]) for r in targets]
    return dict(zip(targets, load_verified(jobs, m.get("checksum", "crc32"))))


def _inventory(s: ReftSnapshotter, verify_all: bool, manifests: dict,
               fused: dict | None = None, max_iteration: int | None = None) -> dict:
    """iteration -> {slot, ok: {own, redundancy, owned}} for this rank.

    Checksums cost a pass over the bytes, so round 1 verifies only what a recovery
    without losses reads (the newest slot's own slice and owned state, and an ARC
    replica, which saves sending that slice over the network) and reports the rest as
    None (unverified); round 2 (``verify_all``) verifies everything. With ``fused`` (a
    dict, filled with region -> (slot, ok)), round 1 writes those regions of the newest
    slot not after ``max_iteration`` into the model while verifying them."""
    out = {}
    fuse_slot = None
    if fused is not None and not verify_all:
        fuse_slot = next((slot for slot, m in sorted(manifests.items(),
                                                     key=lambda kv: -int(kv[1]["iteration"]))
                          if max_iteration is None or int(m["iteration"]) <= max_iteration),
                         None)
    sig = s.layout.signature()
    newest_first = sorted(manifests.items(), key=lambda kv: -int(kv[1]["iteration"]))
    for i, (slot, m) in enumerate(newest_first):
        usable = (m.get("layout") == sig and m.get("nbytes") == s.nbytes and
                  m.get("protection") == s.protection.name)
        flags = {}
        if slot == fuse_slot and usable:
            fused.update({r: (slot, ok) for r, ok in _fuse(s, slot, m).items()})
        aor = m.get("aor") or {}
        for region in ("own", "redundancy", "owned", "aor"):
            if region == "aor" and not (aor.get("valid") and region in m.get("regions", {})):
                flags[region] = False  # no AOR, or a replica that failed verification
                continue
            lazy = not verify_all and (i > 0 or region == "aor" or (
                region == "redundancy" and s.protection.name != "arc"))
            if usable and fused and fused.get(region, (None,))[0] == slot and not verify_all:
                flags[region] = fused[region][1]  # verified on its way into the model
                continue
            flags[region] = None if (usable and lazy) else \
                (usable and s.store.verify(slot, m, region))
        out.setdefault(int(m["iteration"]), {"slot": slot, "ok": flags,
                                             "aor_owner": aor.get("owner")})
    return out


def _needs_full_verify(inventories: list[dict], it, plans) -> bool:
    """Does the round-1 decision depend on anything left unverified?"""
    if not any(None in e["ok"].values() for inv in inventories for e in inv.values()):
        return False
    if it is None:
        return True  # an unverified slot or redundancy block might still recover it
    rebuilt = any(how != OWN for plan in plans.values() for how in plan.values())
    older_slot = any(inv.get(it) is not None and inv[it]["ok"]["own"] is None
                     for inv in inventories)
    return rebuilt or older_slot


def owned_source(inventories: list[dict], ranks: list[int], r: int, it: int):
    """Where rank r's owned (ZeRO-1) state of iteration ``it`` comes from: r itself, the
    AOR holder (member d-1 keeps member d's replica) or None."""
    def ok(rank, region):
        return inventories[rank].get(it, {}).get("ok", {}).get(region, False)

    if ok(r, "owned"):
        return r
    h = ranks[(ranks.index(r) - 1) % len(ranks)]
    if ok(h, "aor") and inventories[h][it].get("aor_owner") == r:
        return h
    return None


def plan_recovery(s: ReftSnapshotter, inventories: list[dict], persistent: int | None,
                  max_iteration: int | None = None):
    """(iteration, {group index: plan}) or (None, reason). Same answer on every rank.
    ``max_iteration``: nothing newer is a candidate (a rollback's target)."""
    groups = s.a.all_dp_groups
    owned_needed = s.layout.owned.nbytes > 0
    candidates = sorted({it for inv in inventories for it in inv
                         if max_iteration is None or it <= max_iteration}, reverse=True)
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
                lost = [r for r in ranks if owned_source(inventories, ranks, r, it) is None]
                if lost:
                    why = (f"ranks {lost} lost their ZeRO-1 optimizer shards " + (
                        "and their holders' AOR replicas" if s.aor is not None else
                        "(no host replica without --reft-protect aor)"))
                    break
            plans[gi] = plan
        if why is None:
            if persistent is not None and persistent > it:
                # + why the newer iterations in host memory could not be rebuilt
                lost = "".join(f"; {r}" for r in reasons[:2])
                return None, (f"the persistent checkpoint (iteration {persistent}) is newer "
                              f"than host memory (iteration {it}){lost}")
            return it, plans
        reasons.append(f"iteration {it}: {why}")
    if not candidates:
        return None, "no snapshot in host memory"
    return None, "; ".join(reasons[:2])


def recovery_tier(inventories: list[dict], groups: list[list[int]], it: int, plans: dict,
                  owned_needed: bool) -> str:
    """The job-wide source of a recovery, for the [REFT] lines and the run summary:
    "own memory" when every rank reloads its own snapshot, else the redundancy that
    rebuilt what was lost ("ARC replica", "AEC parity", "+ AOR replica")."""
    used = {how for plan in plans.values() for how in plan.values()} - {OWN}
    names = {REPLICA: "ARC replica", PARITY: "AEC parity"}
    parts = [names[h] for h in sorted(used)]
    if owned_needed and any(owned_source(inventories, ranks, r, it) != r
                            for ranks in groups for r in ranks):
        parts.append("AOR replica")
    return " + ".join(parts) if parts else "own memory"


def _distribute(s: ReftSnapshotter, inventories, it, plan, data) -> dict:
    """Every member ends with every slice it can get without decoding: its own, its ARC
    replica, and those sent by their holders. Returns slice index -> uint8 tensor."""
    a, L, D = s.a, s.layout.slice_bytes, s.D
    off_own, off_red = s.regions["own"][0], s.regions["redundancy"][0]

    def ok(m, region):
        return bool(inventories[a.dp_ranks[m]].get(it, {}).get("ok", {}).get(region))

    def held(m):  # slice -> where member m has it locally
        h = {}
        if plan[m] == OWN:
            h[m] = off_own
        if s.protection.name == "arc" and ok(m, "redundancy"):
            h[(m + 1) % D] = off_red
        return h

    mine = held(s.member)
    slices = {j: data[o:o + L] for j, o in mine.items()}
    reqs = []
    for j in range(D):
        if plan[j] == PARITY:
            continue
        provider = j if plan[j] == OWN else s.protection.sources(j)[0]
        for m in range(D):
            if m == provider or j in held(m):
                continue
            if s.member == provider:
                reqs.append(torch.distributed.isend(slices[j], dst=a.dp_ranks[m],
                                                    group=a.dp_group, tag=j))
            elif s.member == m:
                slices[j] = torch.empty(L, dtype=torch.uint8)
                reqs.append(torch.distributed.irecv(slices[j], src=a.dp_ranks[provider],
                                                    group=a.dp_group, tag=j))
    for r in reqs:
        r.wait()
    return slices


@torch.no_grad()
def recover(s: ReftSnapshotter, persistent: int | None,
            max_iteration: int | None = None, fuse: bool = True) -> int | None:
    """Restore from host memory; returns the iteration, or None (caller falls back).
    In process (a rollback) with ``max_iteration``: the newest snapshot not after it.

    ``fuse``: round 1 reads the newest slot straight into the model while verifying it
    (native engine only; the two-pass torch path stays the reference). Bytes of a region
    that then fails its checksum are already in the model, so this is done only where
    every outcome overwrites or discards them: a successful restore rewrites every
    region not verified from the restored slot, and None is followed by the persistent
    checkpoint (``persistent``; the caller passes fuse=False when that load skips state,
    e.g. --no-load-optim) or, in a rollback (``max_iteration``), by the job stopping.
    With neither, None means a start from scratch, which needs the untouched model."""
    a = s.a
    fused = {} if (fuse and _native.HAVE_NATIVE and
                   (persistent is not None or max_iteration is not None)) else None
    # ranks arrive at different times (imports): time the recovery, not the arrival skew
    torch.distributed.barrier(group=a.control_group)
    t0 = time.perf_counter()
    manifests = s.store.manifests()  # read once: slot -> manifest
    # only committed iterations are candidates. A commit anywhere means every rank had
    # finished that snapshot (the commit follows a job-wide all-reduce); one finished on
    # some ranks but never committed (a kill inside the snapshot or the commit) is not,
    # even where the others' redundancy could rebuild it: the outcome of a kill must not
    # depend on how far the other ranks got
    c = s.store.committed()
    newest = torch.tensor([int(c["iteration"]) if c else -1], dtype=torch.int64)
    torch.distributed.all_reduce(newest, op=torch.distributed.ReduceOp.MAX,
                                 group=a.control_group)
    committed = int(newest.item())
    max_iteration = committed if max_iteration is None else min(max_iteration, committed)
    for verify_all in (False, True):
        mine = _inventory(s, verify_all, manifests, fused, max_iteration)
        inventories = [None] * a.world_size
        torch.distributed.all_gather_object(inventories, mine, group=a.control_group)
        it, plans = plan_recovery(s, inventories, persistent, max_iteration)
        if not _needs_full_verify(inventories, it, plans):
            break
    t_verify = time.perf_counter()
    if it is None:
        # snapshots of another world size (an elastic shrink, docs/nodes.md): say so
        # rather than report them as lost; their slices are cut for the old DP size
        worlds = {(int(m.get("world_size", a.world_size)), len(m.get("dp_ranks", ())))
                  for m in manifests.values()}
        seen = [None] * a.world_size
        torch.distributed.all_gather_object(seen, sorted(worlds), group=a.control_group)
        worlds = {x for o in seen for x in o}
        other = sorted(worlds - {(a.world_size, s.D)})
        if other and len(worlds) == len(other):  # nothing of this world's layout at all
            plans = (f"host memory holds snapshots of a job of {other[0][0]} ranks "
                     f"(data-parallel size {other[0][1]}), this job has {a.world_size} ranks "
                     f"(data-parallel size {s.D}): REFT-load does not reshard snapshots to "
                     f"another data-parallel size")
        if a.rank == 0:
            reft_print(f"recovery from host memory not possible: {plans}")
        return None
    gi = a.all_dp_groups.index(a.dp_ranks)
    plan = plans[gi]
    s.recovered_from = recovery_tier(inventories, a.all_dp_groups, it, plans,
                                     s.layout.owned.nbytes > 0)
    lay, L = s.layout, s.layout.slice_bytes
    entry = mine.get(it)
    manifest = manifests[entry["slot"]] if entry else None
    data = s.store.data(entry["slot"], s.nbytes) if entry else None
    # 1. what each member already holds (own slice, ARC replica of the next one), and
    #    who sends each slice to the members that lack it (point-to-point)
    slices = _distribute(s, inventories, it, plan, data)
    t_gather = time.perf_counter()
    # 2. lost slices without a replica: rebuilt from the parity blocks of the others
    for lost in sorted(d for d, how in plan.items() if how == PARITY):
        redundancy = {}
        for m in s.protection.sources(lost):
            off, n = s.regions["redundancy"]
            block = data[off:off + n] if m == s.member else torch.empty(n, dtype=torch.uint8)
            torch.distributed.broadcast(block, src=a.dp_ranks[m], group=a.dp_group)
            redundancy[m] = block
        slices[lost] = torch.empty(L, dtype=torch.uint8)
        s.protection.recover(lost, slices, redundancy, slices[lost])
    t_rebuild = time.perf_counter()
    # 3. write the replicated state back, then owned state and metadata; slices that
    #    round 1 already wrote from this slot, verified, are in place (own slice, and
    #    the ARC replica of the next one, which _distribute uses when it verified)
    verified = {r for r, v in (fused or {}).items() if entry and v == (entry["slot"], True)}
    done = {s.member} if plan[s.member] == OWN and "own" in verified else set()
    if "redundancy" in verified:
        done.add((s.member + 1) % s.D)
    for d in range(s.D):
        if d not in done:
            lay.replicated.write(d * L, slices[d])
    sources = [plan[d] for d in range(s.D)]
    meta_src = min(d for d in range(s.D) if plan[d] == OWN)
    if any(how != OWN for how in sources):
        obj = [manifest["meta"] if plan[s.member] == OWN else None]
        torch.distributed.broadcast_object_list(obj, src=a.dp_ranks[meta_src], group=a.dp_group)
        meta = manifest["meta"] if plan[s.member] == OWN else obj[0]
    else:
        meta = manifest["meta"]
    aor_from = None
    if lay.owned.nbytes:
        aor_from = _restore_owned(s, inventories, it, data,
                                  written="owned" in verified)
    a.set_meta(from_jsonable(meta))
    if entry and (c is None or (c.get("slot"), int(c.get("iteration", -1))) !=
                  (entry["slot"], it)):
        # the restored slot becomes this rank's commit pointer (a corrupt, stale or newer
        # one otherwise): the next snapshot must not overwrite what was just restored
        s.store.commit(entry["slot"], it)
    t_end = time.perf_counter()
    ms = 1000 * (t_end - t0)
    # "verify+load": round 1 wrote this slot's verified regions into the model as it read
    split = (f"verify{'+load' if verified else ''}+agree "
             f"{1000 * (t_verify - t0):.0f}, exchange "
             f"{1000 * (t_gather - t_verify):.0f}, rebuild {1000 * (t_rebuild - t_gather):.0f}, "
             f"write back {1000 * (t_end - t_rebuild):.0f} ms")
    how = {"own": "own memory", "replica": "ARC replica", "parity": "AEC parity"}
    stats = torch.tensor([ms], dtype=torch.float64)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=a.control_group)
    lost = sum(1 for d in sources if d != OWN)
    shard = "" if aor_from is None else \
        f", optimizer shard from the AOR replica on rank {aor_from}"
    reft_print(f"recovered iteration {it} on rank {a.rank} from {how[plan[s.member]]}{shard} "
               f"(group {a.dp_ranks}: {lost} slice(s) rebuilt) in {stats.item():.1f} ms "
               f"[this rank: {split}]")
    if a.rank == 0:  # the job's one line: what served it, how long the slowest rank took
        reft_print(f"recovery: iteration {it} restored on {a.world_size} ranks from "
                   f"{s.recovered_from} in {stats.item():.1f} ms")
    return it


def _restore_owned(s: ReftSnapshotter, inventories, it, data,
                   written: bool = False) -> int | None:
    """Owned state from this rank's own snapshot, or, for a rank that lost it, from its
    AOR holder's replica (sent point-to-point within the sharding group). Returns the
    holder's rank when the replica was used. ``written``: round 1 already restored this
    rank's own owned state from this slot, verified."""
    a, ranks = s.a, s.a.dp_ranks
    src = owned_source(inventories, ranks, a.rank, it)
    if src == a.rank and not written:
        off, n = s.regions["owned"]
        s.layout.owned.write(0, data[off:off + n])
    off, n = s.regions["aor"]
    got = None
    for r in ranks:  # same order on every member: at most one exchange per lost rank
        holder = owned_source(inventories, ranks, r, it)
        if holder == r:
            continue
        if a.rank == holder:
            torch.distributed.send(data[off:off + n], dst=r, group=a.dp_group)
        elif a.rank == r:  # the holder's aor region is sized by this rank's shard
            buf = torch.empty(s.aor.owner.spec.nbytes, dtype=torch.uint8)
            torch.distributed.recv(buf, src=holder, group=a.dp_group)
            s.aor.owner.unpack_state(buf)
            got = holder
    return got
