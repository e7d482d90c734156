"""Who protects whom inside a sharding group: one pure function of the group's ranks and
the failure domains (``--reft-ranks-per-node`` consecutive ranks per node).

Members are positions in the group's sorted rank list (member d = ranks[d]) and slicing
stays the paper's: member d snapshots slice d, |P|/D of its stage's replicated state.
Placement decides only where each slice's redundancy lives, always on another failure
domain than the slice's member, so a lost node never takes a slice and its redundancy:

* ARC and AOR: a ring over the members in which neighbours sit on different domains;
  ``ring[i]`` keeps the replica of ``ring[i+1]``'s slice (ARC) and of its optimizer shard
  (AOR). The ring interleaves the domains (the first member of each domain, then the
  second of each, ...), stepping over a node the way NVRx's ``--replication-jump`` does.
  With one member per domain it is the members in order: member d protects d+1, the
  layout of REFT before several members per node were allowed.
* AEC: parity groups of one member per domain (the members at local position p of each
  domain). Each group runs the paper's AEC over its own members, so a node loss costs
  each group one slice at most, which its parities rebuild.

Either survives the loss of any one failure domain per sharding group. What no placement
can protect is refused (:func:`placement_problem`): a group whose members all share one
domain; for ARC/AOR one domain holding more than half of a group (no ring separates
them; an uneven spread below that is placed, the fullest domains on every other seat);
for AEC domains holding unequal numbers of a group's members (Megatron's layouts are
even when the ranks per node are a multiple of TP x CP).

:func:`megatron_dp_groups` gives the sharding groups of a layout from its sizes alone
(megatron-core's rank order), for the checks at argument parsing and for the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

__all__ = ["Placement", "place", "placement_problem", "check_placement",
           "megatron_dp_groups"]


@dataclass(frozen=True)
class Placement:
    """One sharding group's placement (members are indices into ``ranks``)."""

    ranks: tuple[int, ...]                  # the group's global ranks, member d = ranks[d]
    domains: tuple[int, ...]                # member -> failure domain (node)
    ring: tuple[int, ...]                   # ARC/AOR: ring[i] protects ring[i + 1]
    parity_groups: tuple[tuple[int, ...], ...]  # AEC: members whose parities cover each other

    @property
    def D(self) -> int:
        return len(self.ranks)

    @cached_property
    def _seat(self) -> dict[int, int]:
        """member -> its seat on the ring (a plan asks for every member's: O(1) each,
        not a search of the ring, which made a group's plan O(D^2))."""
        return {m: i for i, m in enumerate(self.ring)}

    def protects(self, member: int) -> int:
        """ARC/AOR: the member whose slice (and optimizer shard) ``member`` keeps."""
        return self.ring[(self._seat[member] + 1) % self.D]

    def holder(self, member: int) -> int:
        """ARC/AOR: the member that keeps ``member``'s slice replica (and shard)."""
        return self.ring[(self._seat[member] - 1) % self.D]

    def parity_group(self, member: int) -> tuple[int, ...]:
        """AEC: ``member``'s parity group (itself included, in member order)."""
        return self._parity_of[member]

    @cached_property
    def _parity_of(self) -> dict[int, tuple[int, ...]]:
        return {m: g for g in self.parity_groups for m in g}

    def summary(self, scheme: str, aor: bool = False) -> str:
        """One line: the group, its nodes and who keeps whose copy (global ranks)."""
        r = self.ranks
        parts = []
        if scheme == "arc" or aor:
            keeps = ", ".join(f"{r[d]}->{r[self.protects(d)]}" for d in self.ring)
            label = "+".join(x for x in ("arc" if scheme == "arc" else "",
                                         "aor" if aor else "") if x)
            parts.append(f"{label} copies (keeper->kept) {keeps}")
        if scheme == "aec":
            parts.append("aec parity groups " + " ".join(
                str([r[m] for m in g]) for g in self.parity_groups))
        return (f"sharding group {list(r)} on nodes {list(self.domains)}: "
                + "; ".join(parts))

    def describe(self, scheme: str) -> list[str]:
        """One line per member: where it lives and what it keeps of whom (global ranks)."""
        out = []
        for d, r in enumerate(self.ranks):
            if scheme == "aec":
                others = [self.ranks[m] for m in self.parity_group(d) if m != d]
                keeps = f"AEC parity over ranks {others}"
            elif scheme == "none":
                keeps = "its own slice only"
            else:
                keeps = f"replica of rank {self.ranks[self.protects(d)]}"
            out.append(f"rank {r} (node {self.domains[d]}): slice {d}, {keeps}")
        return out


def _by_domain(domains: Sequence[int]) -> dict[int, list[int]]:
    """domain -> its members, domains in order of first appearance."""
    out: dict[int, list[int]] = {}
    for d, n in enumerate(domains):
        out.setdefault(n, []).append(d)
    return out


def place(ranks: Sequence[int], node_of: Callable[[int], int] | int = 1) -> Placement:
    """The placement of the sharding group ``ranks`` (sorted into member order).
    ``node_of``: rank -> failure domain, or the number of consecutive ranks per domain.
    Always returns one; :func:`placement_problem` says whether it protects anything."""
    ranks = tuple(sorted(ranks))
    of = (lambda r: r // node_of) if isinstance(node_of, int) else node_of
    domains = tuple(of(r) for r in ranks)
    members = list(_by_domain(domains).values())
    depth = max(len(m) for m in members)
    if len({len(m) for m in members}) == 1:  # the regular case: interleave the domains
        ring = tuple(m[p] for p in range(depth) for m in members)
    else:  # unequal: the fullest domains first, on every other seat of the ring
        flat = [d for m in sorted(members, key=len, reverse=True) for d in m]
        seats = list(range(0, len(flat), 2)) + list(range(1, len(flat), 2))
        ring_list = [0] * len(flat)
        for seat, d in zip(seats, flat):
            ring_list[seat] = d
        ring = tuple(ring_list)
    groups = tuple(tuple(sorted(m[p] for m in members if p < len(m))) for p in range(depth))
    return Placement(ranks, domains, ring, groups)


def placement_problem(ranks: Sequence[int], node_of: Callable[[int], int] | int,
                      scheme: str, aor: bool = False) -> str | None:
    """Why no placement of this group survives a lost node under ``scheme`` (none, arc,
    aec; ``aor``: ZeRO-1 shards kept by the ring), or None."""
    if scheme == "none" and not aor:
        return None
    p = place(ranks, node_of)
    per_domain = _by_domain(p.domains)
    what = f"sharding group (ranks {list(p.ranks)}, nodes {list(p.domains)})"
    if len(per_domain) < 2:
        return f"{what} lives on one failure domain: a node loss takes every copy"
    counts = {n: len(m) for n, m in per_domain.items()}
    if (scheme == "arc" or aor) and 2 * max(counts.values()) > p.D:
        return (f"{what} has more than half its members on one failure domain "
                f"(members per node {counts}): a node loss takes a slice and its copy")
    if scheme == "aec" and len(set(counts.values())) > 1:
        return (f"{what} has unequal numbers of members per failure domain "
                f"({counts}): aec needs one parity group member per node"
                + ("" if 2 * max(counts.values()) > p.D else "; --reft-protect arc can "
                   "place it"))
    # (holds by construction; the guard of the property the tests check)
    assert all(p.domains[d] != p.domains[p.protects(d)] for d in range(p.D)) or \
        scheme == "aec", p
    return None


def check_placement(cfg, world_size: int, dp_groups: list[list[int]]) -> None:
    """A ReftConfig's layout checks (``cfg.validate_layout``), then: every sharding group
    can be placed across failure domains for ``--reft-protect``, else a ReftConfigError
    naming the group and the flags that would fix it (before any work is done)."""
    from reft_ext.config import ReftConfigError

    cfg.validate_layout(world_size, dp_groups)
    if (cfg.redundancy == "none" and not cfg.aor) or not cfg.enabled:
        return
    for group in dp_groups:
        why = placement_problem(group, cfg.node_of, cfg.redundancy, cfg.aor)
        if why:
            raise ReftConfigError(
                f"--reft-protect {cfg.protect}: {why} (--reft-ranks-per-node "
                f"{cfg.ranks_per_node}). Spread each data-parallel group over nodes: "
                f"--use-tp-pp-dp-mapping (pipeline stages inside a node, data parallel "
                f"across), a larger tensor/pipeline size per node, or lower "
                f"--reft-ranks-per-node if the nodes really are smaller")


def megatron_dp_groups(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                       order: str = "tp-cp-ep-dp-pp") -> list[list[int]]:
    """megatron-core's data-parallel groups of a layout from its sizes: ranks are laid
    out in ``order`` (the first name varies fastest), and a group is every rank with the
    same tp, cp and pp coordinates. Orders: the default, and ``tp-cp-ep-pp-dp``
    (``--use-tp-pp-dp-mapping``)."""
    dp = world_size // (tp * cp * pp)
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    names = order.split("-")

    def rank(coords: dict) -> int:
        r, stride = 0, 1
        for n in names:
            r += coords[n] * stride
            stride *= sizes[n]
        return r

    return [[rank({"tp": t, "cp": c, "ep": 0, "dp": d, "pp": p}) for d in range(dp)]
            for p in range(pp) for c in range(cp) for t in range(tp)]
