"""REFT-load: after a restart, find the newest iteration the job can rebuild from host
memory, agree on it, and restore it; otherwise say why and let the caller fall back to
the persistent checkpoint.

1. Each rank verifies (CRC) the regions of every snapshot slot in its failure domain and
   reports what it holds (reft_ext/load/inventory.py); the reports are all-gathered.
2. Every rank runs the same deterministic plan (reft_ext/load/planning.py): for each
   candidate iteration (newest first), each sharding group must be able to produce every
   slice (own memory, an ARC replica or AEC parity) and every rank its owned (ZeRO-1)
   state. A newer persistent checkpoint wins. A failure is a typed RecoveryError
   (reft_ext/load/errors.py), logged here.
3. This module does what the plan says: groups exchange their slices, rebuild the lost
   ones from redundancy blocks broadcast by their holders, and write the full replicated
   state back into the model; owned state and metadata (RNG, counters, scheduler) come
   from the rank's own snapshot, or for a replaced rank from a surviving group member
   (DP replicas share them).
"""

from __future__ import annotations

import time

import torch

from reft_ext import _native
from reft_ext.load import preverify
from reft_ext.load.errors import RecoveryError
from reft_ext.load.fused import load_verified
from reft_ext.load.inventory import take_inventory
from reft_ext.load.received import Received, outgoing
from reft_ext.load.repairs import repair_lines
from reft_ext.load.planning import (GroupPlan, RecoveryPlan, needs_full_verify,
                                    other_world_size, owned_source, plan_recovery,
                                    recovery_tier)
from reft_ext.load.view import SnapshotView
from reft_ext.report.events import reft_print
from reft_ext.state.regions import Region, Source
from reft_ext.store.slots import from_jsonable
from reft_ext.testing import fault_point  # the one test injection point (no-op in production)

__all__ = ["recover", "recovery_tier", "owned_source", "plan_recovery"]

_NO_POINTER = 1 << 62  # (the oldest commit pointer: none on this rank)
TAG_AOR = 0xA0F2  # the AOR replica's exchange on the control group (_post_aor)


def _fuse(v: SnapshotView, slot: int, m: dict) -> dict:
    """Round 1's reads of slot ``slot`` (own slice, ARC replica, owned state) verified
    and written into the model in one pass (reft_ext/load/fused.py): region -> whether
    its checksum matched. A failed region has left untrusted bytes in the model, which
    the restore overwrites (every slice and the owned state are written from a trusted
    source unless this slot's verified region is the one the plan restores)."""
    lay, L, D = v.layout, v.layout.slice_bytes, v.D
    targets = {Region.OWN: (lay.replicated, v.member * L), Region.OWNED: (lay.owned, 0)}
    if v.protection.replica_of(v.member) is not None and D > 1:
        targets[Region.REDUNDANCY] = (lay.replicated, v.protection.replica_of(v.member) * L)
    try:
        data = v.store.data(slot, m["nbytes"])
    except (OSError, ValueError):
        return dict.fromkeys(targets, False)
    # (the caller checked the slot's layout: its regions are these targets' sizes)
    jobs = [(data[m["regions"][r][0]:m["regions"][r][0] + m["regions"][r][1]],
             m["regions"][r][2], *targets[r]) for r in targets]
    return dict(zip(targets, load_verified(jobs, m.get("checksum", "crc32"))))


def _distribute(v: SnapshotView, g: GroupPlan, data, it: int, rx: Received) -> dict:
    """Every member ends with every slice it can get without decoding: its own, its ARC
    replica, and those sent by their holders (``g.sends``) in restoring iteration ``it``,
    each checked against its holder's checksum (``rx``). Returns slice index -> uint8
    tensor."""
    L = v.layout.slice_bytes
    slices = {j: data[v.regions[r][0]:v.regions[r][0] + L]
              for j, r in g.held[v.member].items()}
    reqs, got = [], []
    for j, provider, m in g.sends.of(v.member):  # this member's, O(D) (planning.Sends)
        if v.member == provider:
            payload = outgoing(slices[j], it, f"slice {j} (rank {v.dp_ranks[j]}'s)",
                               v.dp_ranks[m])
            reqs.append(torch.distributed.isend(payload, dst=v.dp_ranks[m],
                                                group=v.dp_group, tag=j))
        elif v.member == m:
            slices[j] = torch.empty(L, dtype=torch.uint8)
            reqs.append(torch.distributed.irecv(slices[j], src=v.dp_ranks[provider],
                                                group=v.dp_group, tag=j))
            got.append((j, provider))
    # (tests) a kill while the exchange is in flight: posted, not yet complete
    fault_point("load-exchange", iteration=it)
    for r in reqs:
        r.wait()
    for j, provider in got:
        src = v.dp_ranks[provider]
        rx.check(slices[j], f"slice {j} (rank {v.dp_ranks[j]}'s)", src, src,
                 g.held[provider][j])
    return slices


def _rebuild(v: SnapshotView, g: GroupPlan, data, slices: dict, it: int,
             rx: Received) -> None:
    """Lost slices without a replica: rebuilt from the parity blocks of the others (each
    checked against its holder's checksum; the rebuilt slice against its owner's where
    the owner's manifest survived, e.g. a flipped byte rather than a lost node)."""
    off, n = v.regions[Region.REDUNDANCY]
    for lost, members in g.rebuild:
        redundancy = {}
        for m in members:
            src = v.dp_ranks[m]
            block = outgoing(data[off:off + n], it, "parity block", -1) \
                if m == v.member else torch.empty(n, dtype=torch.uint8)
            torch.distributed.broadcast(block, src=src, group=v.dp_group)
            if m != v.member:
                rx.check(block, f"the {v.protection.name} parity block", src, src,
                         Region.REDUNDANCY)
            redundancy[m] = block
        slices[lost] = torch.empty(v.layout.slice_bytes, dtype=torch.uint8)
        v.protection.recover(lost, slices, redundancy, slices[lost])
        owner = v.dp_ranks[lost]
        rx.check(slices[lost], f"slice {lost} rebuilt from parity", owner, owner,
                 Region.OWN)


def _post_aor(v: SnapshotView, g: GroupPlan, data, it: int,
              manifest: dict | None = None) -> tuple[list, tuple | None]:
    """For a rank that lost its owned state: its AOR holder's replica of it, sent
    point-to-point. Only posted here, on the control group: its own connections, so the
    optimizer shard (the largest transfer, 3x the slice) moves beside the slices'
    exchange on the sharding group instead of after it. Returns (works, (holder,
    buffer) or None); :func:`_receive_aor` waits and checks."""
    off, n = v.regions[Region.AOR]
    works, got = [], None
    for holder, r in g.aor_sends:  # a holder holds one replica: it sends at most once
        if v.rank == holder:
            aor = (manifest or {}).get("aor") or {}
            if not aor.get("exact", True):  # a GPU or fused owner's, between verifications
                reft_print(f"rank {v.rank} sends rank {r} its optimizer shard of iteration "
                           f"{it} from the AOR replica: the CPU replay of its owner's "
                           f"steps since step {aor.get('exact_step')} (exact there; not "
                           f"bit-identical since: docs/aor.md)", event="aor_inexact",
                           iteration=it, owner=r, exact_step=aor.get("exact_step"))
            works.append(torch.distributed.isend(
                outgoing(data[off:off + n], it, "AOR replica", r), dst=r,
                group=v.control_group, tag=TAG_AOR))
        elif v.rank == r:  # the holder's aor region is sized by this rank's shard
            buf = torch.empty(v.aor_owner.spec.nbytes, dtype=torch.uint8)
            works.append(torch.distributed.irecv(buf, src=holder, group=v.control_group,
                                                 tag=TAG_AOR))
            got = (holder, buf)
    return works, got


def _receive_aor(posted: tuple[list, tuple | None], rx: Received) -> tuple | None:
    """The exchange :func:`_post_aor` posted, done and checked against the holder's
    checksum. Returns (holder rank, bytes), or None when this rank keeps its own."""
    works, got = posted
    for w in works:
        w.wait()
    if got is not None:
        rx.check(got[1], "the AOR replica of its optimizer shard", got[0], got[0],
                 Region.AOR)
    return got


def _restore_owned(v: SnapshotView, g: GroupPlan, data, aor, written: bool) -> int | None:
    """Owned state from this rank's own snapshot, or from its AOR holder's replica
    (``aor``: what :func:`_receive_aor` returned). Returns the holder's rank when the
    replica was used. ``written``: round 1 already restored this rank's own owned state
    from this slot, verified."""
    if g.owned_from[v.rank] == v.rank and not written:
        off, n = v.regions[Region.OWNED]
        v.layout.owned.write(0, data[off:off + n])
    if aor is None:
        return None
    v.aor_owner.unpack_state(aor[1])
    return aor[0]


def _other_world_size(v: SnapshotView, manifests: dict):
    """Collective: snapshots of another world size (an elastic shrink, docs/nodes.md)
    are reported as such rather than as lost; their slices are cut for the old DP size."""
    worlds = {(int(m.get("world_size", v.world_size)), len(m.get("dp_ranks", ())))
              for m in manifests.values()}
    seen = [None] * v.world_size
    torch.distributed.all_gather_object(seen, sorted(worlds), group=v.control_group)
    return other_world_size({x for o in seen for x in o}, v.world_size, v.D)


def _agree(v: SnapshotView, manifests: dict, persistent: int | None,
           max_iteration: int | None, fused: dict | None):
    """Rounds 1 (and, where the decision depends on what it left unverified, 2) of
    inventory + plan: (plan or the RecoveryError, every rank's inventory)."""
    fmt, facts = v.slot_format, v.facts
    early = preverify.take((v.store.dir, v.store.rank))  # begun at an in-process restart's abandon
    verify_region = v.store.verify if early is None else early.verify(v.store.verify)
    failed = set()  # (slot, region) that failed its checksum: named after the plan

    def verify(slot, m, region):
        ok = verify_region(slot, m, region)
        if not ok:
            failed.add((slot, Region(region)))
        return ok
    for verify_all in (False, True):
        mine = take_inventory(manifests, fmt, verify_all, verify,
                              lambda slot, m: _fuse(v, slot, m), fused, max_iteration)
        inventories = [None] * v.world_size
        torch.distributed.all_gather_object(inventories, mine, group=v.control_group)
        try:
            plan = plan_recovery(inventories, facts, persistent, max_iteration)
        except RecoveryError as e:
            plan = e
        if not needs_full_verify(inventories, None if isinstance(plan, RecoveryError)
                                 else plan):
            break
    failed.update((slot, Region(r)) for r, (slot, ok) in (fused or {}).items() if not ok)
    return plan, inventories, failed


@torch.no_grad()
def recover(s, persistent: int | None,
            max_iteration: int | None = None, fuse: bool = True) -> int | None:
    """Restore from host memory; returns the iteration, or None (caller falls back).
    In process (a rollback) with ``max_iteration``: the newest snapshot not after it.
    Why memory could not serve (a RecoveryError) is logged by rank 0, not raised.

    ``fuse``: round 1 reads the newest slot straight into the model while verifying it
    (native engine only; the two-pass torch path stays the reference). Bytes of a region
    that then fails its checksum are already in the model, so this is done only where
    every outcome overwrites or discards them: a successful restore rewrites every
    region not verified from the restored slot, and None is followed by the persistent
    checkpoint (``persistent``; the caller passes fuse=False when that load skips state,
    e.g. --no-load-optim) or, in a rollback (``max_iteration``), by the job stopping.
    With neither, None means a start from scratch, which needs the untouched model."""
    v = SnapshotView.of(s)
    fused = {} if (fuse and _native.HAVE_NATIVE and
                   (persistent is not None or max_iteration is not None)) else None
    # ranks arrive at different times (imports): time the recovery, not the arrival skew
    torch.distributed.barrier(group=v.control_group)
    t0 = time.perf_counter()
    manifests = v.store.manifests()  # read once: slot -> manifest
    # only committed iterations are candidates: the outcome of a kill must not depend on
    # how far the other ranks got, so one sealed on some ranks and not committed is not,
    # even where the others' redundancy could rebuild it. Pointers may differ by one
    # iteration (store/commit.py). Local commits: a rank may have sealed i while another
    # still points at i-1 (it lags, or it died inside the commit); every rank keeps i-1
    # in its ring until every rank has sealed i, so the oldest pointer is the one every
    # rank holds; no live rank lags by two, so an older pointer is stale (a flushed copy
    # from an earlier failure, reft_ext/load/flushed.py) and not waited for. Job-wide:
    # a kill inside the commit (after its all-reduce) leaves some pointers at i and
    # others at i-1, i is then sealed on every rank, and a rank at i may already have
    # overwritten i-1: the newest is the one every rank holds
    c = v.store.committed()
    mine_c = int(c["iteration"]) if c else -1
    pointers = torch.tensor([mine_c, -(mine_c if c else _NO_POINTER)], dtype=torch.int64)
    torch.distributed.all_reduce(pointers, op=torch.distributed.ReduceOp.MAX,
                                 group=v.control_group)
    newest, oldest = int(pointers[0].item()), -int(pointers[1].item())
    committed = newest if not v.local_commits or oldest == _NO_POINTER else \
        max(oldest, newest - 1)
    if v.rank == 0 and oldest != _NO_POINTER and oldest < newest:
        why = (f"{committed} is held by every rank (commits are local: no rank "
               f"overwrites it before every rank has sealed {committed + 1})"
               if v.local_commits else
               f"the newest, {committed}, was committed job-wide (sealed on every rank "
               f"before any pointer moved)")
        reft_print(f"commit pointers differ across ranks (iterations {oldest} to "
                   f"{newest}: a rank one snapshot behind, or a failure inside a commit): "
                   f"{why}", event="commit_pointers_differ", oldest=oldest, newest=newest,
                   chosen=committed)
    max_iteration = committed if max_iteration is None else min(max_iteration, committed)
    plan, inventories, failed = _agree(v, manifests, persistent, max_iteration, fused)
    t_verify = time.perf_counter()
    if isinstance(plan, RecoveryError):
        why = _other_world_size(v, manifests) or plan
        if v.rank == 0:
            reft_print(f"recovery from host memory not possible: {why}",
                       event="recovery_impossible", reason=str(why))
        return None
    # (tests) a kill after the inventory reads (round 1 may have loaded into the model)
    fault_point("load-read", iteration=plan.iteration)
    if not _restore(v, plan, inventories, manifests, fused, c, (t0, t_verify)):
        return None
    _report_repairs(v, plan, failed, manifests)
    s.recovered_from = plan.tier  # (the snapshotter keeps it for the trainer's summary)
    return plan.iteration


def _report_repairs(v: SnapshotView, plan: RecoveryPlan, failed: set, manifests: dict):
    """A [REFT] line per region of the restored slot that failed its checksum: the file
    (a flushed one imported into memory is named as such) and what served it instead."""
    if not failed:
        return
    imported = getattr(v.store, "imported_from", {})  # reft_ext/load/flushed.py
    files = {slot: imported.get(slot) or v.store._path(v.store._name(slot, "bin"))
             for slot in manifests}
    for line in repair_lines(v.rank, plan.iteration, plan.groups[v.group_index], failed,
                             manifests, files):
        reft_print(line, event="checksum_repaired", rank=v.rank, iteration=plan.iteration)


def _restore(v: SnapshotView, plan: RecoveryPlan, inventories: list, manifests: dict,
             fused: dict | None, c: dict | None, t: tuple[float, float]) -> bool:
    """Do this rank's part of ``plan``, then log it. False (nothing written, every rank
    agrees) when bytes received from a peer failed their checksum."""
    t0, t_verify = t
    it, g = plan.iteration, plan.groups[v.group_index]
    lay, L, member = v.layout, v.layout.slice_bytes, v.member
    entry = inventories[v.rank].get(it)
    manifest = manifests[entry.slot] if entry else None
    data = v.store.data(entry.slot, v.nbytes) if entry else None
    rx = Received(v.rank, it, inventories)
    # an owned shard lost with its rank: its AOR replica, posted first (it moves
    # beside steps 1 and 2 on other connections)
    aor_posted = _post_aor(v, g, data, it, manifest) if lay.owned.nbytes else None
    # 1. what each member already holds (own slice, ARC replica of the next one), and
    #    who sends each slice to the members that lack it (point-to-point)
    slices = _distribute(v, g, data, it, rx)
    t_gather = time.perf_counter()
    # 2. lost slices without a replica: rebuilt from the parity blocks of the others
    _rebuild(v, g, data, slices, it, rx)
    aor = _receive_aor(aor_posted, rx) if aor_posted is not None else None
    t_rebuild = time.perf_counter()
    # 3. nothing received from a peer is written before every rank checked what it got
    if not rx.agree(v.control_group):
        if v.rank == 0:
            reft_print(f"recovery from host memory refused: data received from peers "
                       f"while restoring iteration {it} failed its checksums (the lines "
                       f"of the ranks that received it); falling back", event="recovery_impossible",
                       reason="received data failed its checksum")
        return False
    # 4. write the replicated state back, then owned state and metadata; slices that
    #    round 1 already wrote from this slot, verified, are in place (own slice, and
    #    the ARC replica of the next one, which _distribute uses when it verified)
    verified = {r for r, ok in (fused or {}).items() if entry and ok == (entry.slot, True)}
    mine_own = g.slices[member] == Source.OWN
    done = {member} if mine_own and Region.OWN in verified else set()
    if Region.REDUNDANCY in verified:
        done.add(v.protection.replica_of(member))
    for d in range(v.D):
        if d not in done:
            lay.replicated.write(d * L, slices[d])
    # (tests) a kill with the slices rebuilt and written back, owned state, metadata and
    # commit pointer not yet
    fault_point("load-rebuild", iteration=it)
    if g.meta_from is not None:  # members that rebuild their slice take a peer's metadata
        obj = [manifest["meta"] if mine_own else None]
        torch.distributed.broadcast_object_list(obj, src=v.dp_ranks[g.meta_from],
                                                group=v.dp_group)
        meta = manifest["meta"] if mine_own else obj[0]
    else:
        meta = manifest["meta"]
    aor_from = None
    if lay.owned.nbytes:
        aor_from = _restore_owned(v, g, data, aor, written=Region.OWNED in verified)
    v.set_meta(from_jsonable(meta))
    if entry and (c is None or (c.get("slot"), int(c.get("iteration", -1))) !=
                  (entry.slot, it)):
        # the restored slot becomes this rank's commit pointer (a corrupt, stale or newer
        # one otherwise): the next snapshot must not overwrite what was just restored
        v.store.commit(entry.slot, it)
    t_end = time.perf_counter()
    ms = 1000 * (t_end - t0)
    # "verify+load": round 1 wrote this slot's verified regions into the model as it read
    split = (f"verify{'+load' if verified else ''}+agree "
             f"{1000 * (t_verify - t0):.0f}, exchange "
             f"{1000 * (t_gather - t_verify):.0f}, rebuild {1000 * (t_rebuild - t_gather):.0f}, "
             f"write back {1000 * (t_end - t_rebuild):.0f} ms")
    stats = torch.tensor([ms], dtype=torch.float64)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=v.control_group)
    shard = "" if aor_from is None else \
        f", optimizer shard from the AOR replica on rank {aor_from}"
    source = g.slices[member]
    reft_print(f"recovered iteration {it} on rank {v.rank} from {source.label}{shard} "
               f"(group {v.dp_ranks}: {g.rebuilt} slice(s) rebuilt) in {stats.item():.1f} ms "
               f"[this rank: {split}]", event="recovered", iteration=it, rank=v.rank,
               source=str(source), aor_from=aor_from, group=list(v.dp_ranks),
               rebuilt=g.rebuilt, ms=stats.item(), verify_load=bool(verified))
    if v.rank == 0:  # the job's one line: what served it, how long the slowest rank took
        reft_print(f"recovery: iteration {it} restored on {v.world_size} ranks from "
                   f"{plan.tier} in {stats.item():.1f} ms", event="recovery",
                   iteration=it, ranks=v.world_size, source=plan.tier,
                   ms=stats.item())
    return True
