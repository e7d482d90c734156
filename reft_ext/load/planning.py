"""What REFT-load decides, as pure functions of the all-gathered inventories.

Every rank runs the same plan on the same inputs, so every rank reaches the same answer
without another round of agreement. The inputs are the inventories (what each rank holds
per iteration, reft_ext/load/inventory.py) and the facts of the job's layout
(:class:`JobFacts`: the sharding groups, the protection scheme, ZeRO-1 state, AOR); the
answer is a :class:`RecoveryPlan` (the iteration, and per sharding group where every slice,
every rank's owned state and its metadata come from, and which messages move them) or a
typed :class:`~reft_ext.load.errors.RecoveryError` saying why host memory cannot serve
the restart. reft_ext/load/recover.py and reshard.py then do the I/O and the collectives.

The choice of iteration is one function (:func:`choose_iteration`) for both a restart
(:func:`plan_recovery`) and an elastic shrink (:func:`plan_reshard`): the newest candidate
every group can rebuild, unless the persistent checkpoint is newer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence, TypeVar

from reft_ext.load.errors import (BeyondProtection, MissingHandover, MixedOldGroups,
                                  NoCommonIteration, NoMetadataSource, NoRestorableIteration,
                                  NoSnapshot, OtherWorldSize, OwnedStateLost,
                                  PersistentIsNewer, SlicesLeft, Unrestorable)
from reft_ext.load.inventory import Held, Offer, as_inventories, flag
from reft_ext.protect.placement import Placement, place
from reft_ext.protect.schemes import Protection, make_protection
from reft_ext.state.regions import Region, Source

T = TypeVar("T")


@dataclass(frozen=True)
class JobFacts:
    """The layout facts a plan depends on (the same on every rank)."""

    groups: list[list[int]]  # every sharding group's global ranks; member d = ranks[d]
    scheme: str              # --reft-protect: none | arc | aec
    owned_needed: bool       # ranks have owned (ZeRO-1) state to restore
    aor: bool = False        # AOR keeps a host replica of every owned shard
    ranks_per_node: int = 1  # consecutive ranks per failure domain (the placement's)

    def placement(self, ranks: list[int]) -> Placement:
        """Who keeps whose redundancy in the group ``ranks`` (as REFT-save placed it)."""
        return place(ranks, self.ranks_per_node)


@dataclass(frozen=True)
class GroupPlan:
    """How one sharding group restores an iteration."""

    ranks: list[int]
    slices: dict[int, Source]        # member -> where its slice comes from
    owned_from: dict[int, int]       # rank -> rank whose slot holds its owned state: itself,
    #                                  or its AOR holder (empty without owned state)
    meta_from: int | None            # member whose manifest metadata the members that
    #                                  rebuild their slice take (None: nobody rebuilds)
    held: list[dict[int, Region]]    # member -> {slice: region of its own slot holding it}
    sends: "Sends"                   # (slice, from member, to member), in posting order
    rebuild: list[tuple[int, list[int]]]  # (lost member, members whose parity it needs)

    @property
    def rebuilt(self) -> int:
        """Slices not restored from their member's own memory."""
        return sum(1 for how in self.slices.values() if how != Source.OWN)

    def meta_source(self, member: int) -> int:
        """The member whose manifest metadata ``member`` takes."""
        return member if self.slices[member] == Source.OWN else self.meta_from

    @property
    def aor_sends(self) -> list[tuple[int, int]]:
        """(holder, owner) per rank whose owned state comes from an AOR replica, in
        group order (the order the point-to-point messages are made in)."""
        return [(h, r) for r in self.ranks if (h := self.owned_from[r]) != r] \
            if self.owned_from else []


@dataclass(frozen=True)
class RecoveryPlan:
    iteration: int
    groups: dict[int, GroupPlan]  # group index (in JobFacts.groups) -> its plan
    tier: str                     # the job-wide source, for the [REFT] lines and summary


def owned_source(inventories: list[dict[int, Held]], ranks: list[int], r: int,
                 it: int, ranks_per_node: int = 1,
                 placement: Placement | None = None) -> int | None:
    """Where rank r's owned (ZeRO-1) state of iteration ``it`` comes from: r itself, its
    AOR holder (the member before it on the placement's ring) or None. ``placement``:
    the group's, when the caller asks for every member (placing it once, not D times)."""
    if flag(inventories, r, it, Region.OWNED):
        return r
    p = placement or place(ranks, ranks_per_node)
    h = p.ranks[p.holder(p.ranks.index(r) if placement is None else _member_of(p, r))]
    if flag(inventories, h, it, Region.AOR) and inventories[h][it].aor_owner == r:
        return h
    return None


class Sends(Sequence):
    """Who sends each slice to the members that lack it: (slice, from member, to member)
    in posting order (slice by slice, receivers in member order). A group of D members
    has O(D^2) of them; a rank posts only its own (:meth:`of`, O(D)), so the list is
    made only when asked for as a whole (tests, equality)."""

    def __init__(self, providers: list[int | None], held: list[dict[int, Region]]):
        self.providers, self.held = providers, held  # slice -> provider (None: parity)
        self._all: list | None = None

    def of(self, member: int) -> list[tuple[int, int, int]]:
        """The sends ``member`` posts or receives, in the group's posting order."""
        out, D = [], len(self.providers)
        for j, provider in enumerate(self.providers):
            if provider is None:
                continue
            if provider == member:
                out += [(j, provider, m) for m in range(D)
                        if m != provider and j not in self.held[m]]
            elif j not in self.held[member]:
                out.append((j, provider, member))
        return out

    def _list(self) -> list:
        if self._all is None:
            D = len(self.providers)
            self._all = [(j, p, m) for j, p in enumerate(self.providers) if p is not None
                         for m in range(D) if m != p and j not in self.held[m]]
        return self._all

    def __getitem__(self, i):
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Sends)) else \
            NotImplemented

    def __repr__(self) -> str:
        return repr(self._list())


def _member_of(p: Placement, r: int) -> int:
    return p.__dict__.setdefault("_member", {x: d for d, x in enumerate(p.ranks)})[r]


def _exchange(slices: dict[int, Source], red_ok: list[bool], protection: Protection):
    """What each member holds locally (its own slice unless lost, its verified ARC
    replica) and who sends each slice to the members that lack it."""
    D, sources = len(slices), protection.sources
    held = []
    for m in range(D):
        h = {}
        if slices[m] == Source.OWN:
            h[m] = Region.OWN
        if protection.replica_of(m) is not None and red_ok[m]:
            h[protection.replica_of(m)] = Region.REDUNDANCY
        held.append(h)
    # PARITY: rebuilt by every member from the broadcast parities (no sender)
    providers = [None if slices[j] == Source.PARITY else
                 j if slices[j] == Source.OWN else sources(j)[0] for j in range(D)]
    return held, Sends(providers, held)


def plan_group(inventories: list[dict[int, Held]], job: JobFacts, ranks: list[int],
               it: int) -> GroupPlan:
    """One sharding group's plan for iteration ``it``, or :class:`Unrestorable`."""
    placement = job.placement(ranks)
    protection = make_protection(job.scheme, placement)
    own_ok = [flag(inventories, r, it, Region.OWN) for r in ranks]
    red_ok = [flag(inventories, r, it, Region.REDUNDANCY) for r in ranks]
    how = protection.plan(own_ok, red_ok)
    if how is None:
        raise BeyondProtection(ranks, [r for r, ok in zip(ranks, own_ok) if not ok],
                               protection.name)
    slices = {d: Source(h) for d, h in how.items()}
    owned = {}
    if job.owned_needed:
        owned = {r: owned_source(inventories, ranks, r, it, job.ranks_per_node, placement)
                 for r in ranks}
        lost = [r for r in ranks if owned[r] is None]
        if lost:
            raise OwnedStateLost(lost, job.aor)
    meta_from = None
    if any(h != Source.OWN for h in slices.values()):
        own = [d for d in range(len(ranks)) if slices[d] == Source.OWN]
        if not own:
            raise NoMetadataSource(ranks)
        meta_from = min(own)
    held, sends = _exchange(slices, [bool(x) for x in red_ok], protection)
    rebuild = [(d, protection.sources(d)) for d in sorted(slices)
               if slices[d] == Source.PARITY]
    return GroupPlan(list(ranks), slices, owned, meta_from, held, sends, rebuild)


def plan_iteration(inventories: list[dict[int, Held]], job: JobFacts,
                   it: int) -> dict[int, GroupPlan]:
    """Every group's plan for ``it``; :class:`Unrestorable` from the first that has none."""
    return {gi: plan_group(inventories, job, ranks, it) for gi, ranks in enumerate(job.groups)}


def choose_iteration(candidates: Iterable[int], plan_one: Callable[[int], T],
                     persistent: int | None, cite_skipped: bool = True) -> tuple[int, T]:
    """The newest candidate ``plan_one`` can plan (it raises :class:`Unrestorable` for
    one it cannot) and its plan. Raises :class:`PersistentIsNewer` when the persistent
    checkpoint (iteration ``persistent``) is newer than that (``cite_skipped``: the
    message also says why the newer ones failed), :class:`NoSnapshot` without
    candidates, :class:`NoRestorableIteration` when none can be planned."""
    candidates = sorted(candidates, reverse=True)
    skipped: dict[int, Unrestorable] = {}
    for it in candidates:
        try:
            plan = plan_one(it)
        except Unrestorable as why:
            skipped[it] = why
            continue
        if persistent is not None and persistent > it:
            raise PersistentIsNewer(persistent, it, skipped if cite_skipped else None)
        return it, plan
    if not candidates:
        raise NoSnapshot()
    raise NoRestorableIteration(skipped)


def plan_recovery(inventories: list, job: JobFacts, persistent: int | None,
                  max_iteration: int | None = None) -> RecoveryPlan:
    """The job's plan, or a RecoveryError. ``max_iteration``: nothing newer is a
    candidate (the commit every rank holds, or a rollback's target)."""
    inventories = as_inventories(inventories)
    candidates = {it for inv in inventories for it in inv
                  if max_iteration is None or it <= max_iteration}
    it, groups = choose_iteration(candidates, lambda i: plan_iteration(inventories, job, i),
                                  persistent)
    tier = recovery_tier(inventories, job.groups, it,
                         {gi: g.slices for gi, g in groups.items()}, job.owned_needed,
                         job.ranks_per_node)
    return RecoveryPlan(it, groups, tier)


def recovery_tier(inventories: list, groups: list[list[int]], it: int, plans: dict,
                  owned_needed: bool, ranks_per_node: int = 1) -> str:
    """The job-wide source of a recovery, for the [REFT] lines and the run summary:
    "own memory" when every rank reloads its own snapshot, else the redundancy that
    rebuilt what was lost ("ARC replica", "AEC parity", "+ AOR replica").
    ``plans``: group index -> {member: source}."""
    inventories = as_inventories(inventories)
    used = {Source(how) for plan in plans.values() for how in plan.values()} - {Source.OWN}
    parts = [h.label for h in sorted(used)]
    if owned_needed and any(owned_source(inventories, ranks, r, it, ranks_per_node,
                                         place(ranks, ranks_per_node)) != r
                            for ranks in groups for r in ranks
                            if not flag(inventories, r, it, Region.OWNED)):
        parts.append("AOR replica")
    return " + ".join(parts) if parts else "own memory"


def needs_full_verify(inventories: list, plan: RecoveryPlan | None) -> bool:
    """Does round 1's decision (``plan``, None when it failed) depend on anything left
    unverified? Then round 2 verifies every region and plans again."""
    inventories = as_inventories(inventories)
    if not any(None in e.ok.values() for inv in inventories for e in inv.values()):
        return False
    if plan is None:
        return True  # an unverified slot or redundancy block might still recover it
    rebuilt = any(g.rebuilt for g in plan.groups.values())
    it = plan.iteration
    older_slot = any(inv.get(it) is not None and inv[it].ok[Region.OWN] is None
                     for inv in inventories)
    return rebuilt or older_slot


def other_world_size(worlds: set[tuple[int, int]], world_size: int,
                     D: int) -> OtherWorldSize | None:
    """``worlds``: (world size, data-parallel size) of every snapshot any rank holds.
    The error to report when none is of this job's size (snapshots of the job before a
    shrink), else None."""
    other = sorted(worlds - {(world_size, D)})
    if other and len(worlds) == len(other):  # nothing of this world's layout at all
        return OtherWorldSize(other[0], world_size, D)
    return None


# ---- after an elastic shrink (reft_ext/load/reshard.py) -----------------------------------
class ReshardPlan(NamedTuple):
    iteration: int
    providers: dict[int, list[int]]  # new group index -> provider rank of each old slice


def plan_reshard(offers: list, groups: list[list[int]], persistent: int | None) -> ReshardPlan:
    """The iteration of the old job to reshard and who provides each old slice, or a
    RecoveryError. Same answer on every rank."""
    offers = [Offer.of(o) for o in offers]
    if any(o is None for o in offers):
        raise MissingHandover([r for r, o in enumerate(offers) if o is None])
    common = set.intersection(*[set(o.iters) for o in offers])
    if not common:
        raise NoCommonIteration(next((o.why for o in offers if o.why), ""))

    def plan_one(it: int) -> dict[int, list[int]]:
        plans = {}
        for gi, ranks in enumerate(groups):
            e = [offers[r].iters[it] for r in ranks]
            if len({tuple(x.old_group) for x in e}) != 1:
                raise MixedOldGroups(ranks)
            providers = [next((r for r, x in zip(ranks, e) if j in x.have), None)
                         for j in range(e[0].D)]
            lost = [e[0].old_group[j] for j, p in enumerate(providers) if p is None]
            if lost:
                raise SlicesLeft(lost, e[0].old_group, e[0].protection)
            plans[gi] = providers
        return plans

    # (a newer persistent checkpoint is named without the old iterations' reasons)
    return ReshardPlan(*choose_iteration(common, plan_one, persistent, cite_skipped=False))
