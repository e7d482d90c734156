"""What each rank holds in host memory, as REFT-load's planners see it.

An inventory is this rank's answer to "which iterations could you contribute to, and
which regions of them did you verify?": ``{iteration: Held}``. Every rank takes its own
(:func:`take_inventory`), the inventories are all-gathered, and every rank then runs the
same pure plan over the list (reft_ext/load/planning.py). After an elastic shrink the
same role is played by an :class:`Offer` (which slices of the OLD job's group a survivor
holds; :func:`take_offer`).

The I/O (reading checksums, the fused verify-and-load) is passed in as callables, so the
decisions here (which slot is usable, which regions round 1 leaves unverified) run in unit
tests on fake manifests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from reft_ext.state.regions import Region

REGIONS = (Region.OWN, Region.REDUNDANCY, Region.OWNED, Region.AOR)

@dataclass(frozen=True)
class Held:
    """One rank's snapshot of one iteration: its slot, a flag per region (True verified,
    False failed, unusable or absent, None not verified yet), whose optimizer shard
    its AOR region holds, and the checksum its writer recorded for each region (with
    the algorithm): a peer that receives those bytes during the restore checks them
    against it (reft_ext/load/received.py)."""

    slot: int
    ok: Mapping[Region, bool | None]
    aor_owner: int | None = None
    sums: Mapping[Region, int] = field(default_factory=dict)
    algorithm: str = "crc32"

    def has(self, region: Region) -> bool | None:
        return self.ok.get(region, False)

    @classmethod
    def of(cls, obj: Any) -> "Held":
        """A Held, or the plain-dict form ({"slot", "ok", "aor_owner"}) of one."""
        if isinstance(obj, Held):
            return obj
        return cls(obj["slot"], {Region(k): v for k, v in obj["ok"].items()},
                   obj.get("aor_owner"),
                   {Region(k): int(v) for k, v in obj.get("sums", {}).items()},
                   obj.get("algorithm", "crc32"))


def as_inventories(inventories: list) -> list[dict[int, Held]]:
    """Inventories as :class:`Held` entries (accepts the plain-dict form too); a rank that
    sent nothing (None) holds nothing. One already in that form is taken as it is (the
    planner converts once and passes the result on: at 16,384 ranks a copy costs more
    than the plan)."""
    return [inv if _converted(inv) else
            {int(it): Held.of(e) for it, e in (inv or {}).items()} for inv in inventories]


def _converted(inv) -> bool:
    return type(inv) is dict and all(type(k) is int and type(e) is Held
                                     for k, e in inv.items())


def flag(inventories: list[dict[int, Held]], rank: int, it: int,
         region: Region) -> bool | None:
    """Rank's flag for ``region`` of iteration ``it`` (False when it holds no such slot)."""
    e = inventories[rank].get(it)
    return e.has(region) if e is not None else False


@dataclass(frozen=True)
class SlotFormat:
    """What a slot must be written for to be loadable here (else all its regions read
    False): this state's layout signature, slot size and protection scheme."""

    signature: dict
    nbytes: int
    scheme: str

    def usable(self, m: dict) -> bool:
        return (m.get("layout") == self.signature and m.get("nbytes") == self.nbytes and
                m.get("protection") == self.scheme)


def newest_first(manifests: dict[int, dict]) -> list[tuple[int, dict]]:
    """(slot, manifest) by iteration, newest first (ties keep the store's slot order)."""
    return sorted(manifests.items(), key=lambda kv: -int(kv[1]["iteration"]))


def fuse_slot(manifests: dict[int, dict], max_iteration: int | None) -> int | None:
    """The slot round 1 reads straight into the model: the newest not after
    ``max_iteration`` (a rollback's target, or the commit every rank holds)."""
    return next((slot for slot, m in newest_first(manifests)
                 if max_iteration is None or int(m["iteration"]) <= max_iteration), None)


def take_inventory(manifests: dict[int, dict], fmt: SlotFormat, verify_all: bool,
                   verify: Callable[[int, dict, Region], bool],
                   fuse: Callable[[int, dict], dict[Region, bool]] | None = None,
                   fused: dict | None = None,
                   max_iteration: int | None = None) -> dict[int, Held]:
    """iteration -> Held for this rank.

    Checksums cost a pass over the bytes, so round 1 verifies only what a recovery
    without losses reads (the newest slot's own slice and owned state, and an ARC
    replica, which saves sending that slice over the network) and reports the rest as
    None (unverified); round 2 (``verify_all``) verifies everything. With ``fused`` (a
    dict, filled with region -> (slot, ok)), round 1 calls ``fuse(slot, manifest)`` on the
    newest slot not after ``max_iteration``, which writes those regions into the model
    while verifying them, and takes its verdicts instead of verifying again."""
    out: dict[int, Held] = {}
    fusing = fused is not None and not verify_all
    target = fuse_slot(manifests, max_iteration) if fusing else None
    for i, (slot, m) in enumerate(newest_first(manifests)):
        usable = fmt.usable(m)
        flags: dict[Region, bool | None] = {}
        if fusing and slot == target and usable:
            fused.update({r: (slot, ok) for r, ok in fuse(slot, m).items()})
        aor = m.get("aor") or {}
        for region in REGIONS:
            if region is Region.AOR and not (aor.get("valid") and region in m.get("regions", {})):
                flags[region] = False  # no AOR, or a replica that failed verification
                continue
            lazy = not verify_all and (i > 0 or region is Region.AOR or (
                region is Region.REDUNDANCY and fmt.scheme != "arc"))
            if usable and fused and fused.get(region, (None,))[0] == slot and not verify_all:
                flags[region] = fused[region][1]  # verified on its way into the model
                continue
            flags[region] = None if (usable and lazy) else \
                (usable and verify(slot, m, region))
        sums = {Region(r): int(v[2]) for r, v in m.get("regions", {}).items()
                if len(v) > 2} if usable else {}
        out.setdefault(int(m["iteration"]), Held(slot, flags, aor.get("owner"), sums,
                                                 m.get("checksum", "crc32")))
    return out


# ---- after an elastic shrink: the old job's slices ----------------------------------------
@dataclass(frozen=True)
class OldHeld:
    """A survivor's snapshot of one iteration of the old job: which old slices it holds
    (old member index -> the region of its slot that holds it) and the checksum recorded
    for each (a receiver checks what it gets against it)."""

    slot: int
    old_group: list[int]
    D: int
    slice: int
    have: Mapping[int, Region]
    protection: str
    sums: Mapping[int, int] = field(default_factory=dict)
    algorithm: str = "crc32"


@dataclass(frozen=True)
class Offer:
    """What one survivor brings from the old job (its old rank, per old iteration), and
    why it brings nothing where a snapshot did not fit this job's state."""

    old_rank: int
    iters: dict[int, OldHeld] = field(default_factory=dict)
    why: str = ""

    @classmethod
    def of(cls, obj: Any) -> "Offer | None":
        """An Offer, or its plain-dict form; None stays None (no handover note)."""
        if obj is None or isinstance(obj, Offer):
            return obj
        iters = {int(it): OldHeld(e["slot"], list(e["old_group"]), e["D"], e["slice"],
                                  {int(j): Region(r) for j, r in e["have"].items()},
                                  e["protection"],
                                  {int(j): int(c) for j, c in e.get("sums", {}).items()},
                                  e.get("algorithm", "crc32"))
                 for it, e in obj["iters"].items()}
        return cls(obj["old_rank"], iters, obj.get("why", ""))


def take_offer(manifests: dict[int, dict], note: dict, replicated_sig: list,
               owned_nbytes: int, verify: Callable[[int, dict, Region], bool]) -> Offer:
    """Which old slices this rank holds (verified), per iteration of the old job.
    ``note``: this rank's handover (its old rank and the old world size);
    ``replicated_sig``/``owned_nbytes``: this job's replicated layout and ZeRO-1 state."""
    iters, why = {}, ""
    for slot, m in manifests.items():
        sig = m.get("layout", {})
        if m.get("world_size") != note["world_size"] or m.get("rank") != note["rank"]:
            continue
        if sig.get("replicated") != replicated_sig:
            why = "the replicated state (params, optimizer) differs from the snapshot's"
            continue
        if sig.get("owned", [0, 0])[1] or owned_nbytes:
            why = "ZeRO-1 optimizer shards (--use-distributed-optimizer) are cut for the old " \
                  "data-parallel size"
            continue
        D, member, prot = sig["group_size"], m["member"], m.get("protection")
        have = {}
        if verify(slot, m, Region.OWN):
            have[member] = Region.OWN
        # an AEC parity block of a group of 2 is the other member's slice
        if (prot == "arc" or (prot == "aec" and D == 2)) and D > 1 and \
                verify(slot, m, Region.REDUNDANCY):
            j = m.get("replica_of")  # ARC: the placement's ring (aec of 2: the other one)
            have[(member + 1) % D if j is None else j] = Region.REDUNDANCY
        sums = {j: int(m["regions"][r][2]) for j, r in have.items()}
        iters[int(m["iteration"])] = OldHeld(slot, m["dp_ranks"], D, sig["slice_bytes"],
                                             have, prot, sums, m.get("checksum", "crc32"))
    return Offer(note["rank"], iters, why)
