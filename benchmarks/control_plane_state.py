"""A synthetic REFT state of the right shape for benchmarks/bench_control_plane.py: one
rank's snapshot manifests (three slots, ARC, ZeRO-1 owned state with AOR), its real
REFT-load inventory (reft_ext/load/inventory.py), and the real plan over W of them
(reft_ext/load/planning.py) for a TP x PP x DP layout with the lost ranks holding
nothing. No model, no bytes: only what the agreement and the plan read."""

from __future__ import annotations

import pickle

from reft_ext.load.inventory import SlotFormat, as_inventories, take_inventory
from reft_ext.load.planning import JobFacts, plan_recovery

SIG = {"replicated": [["w", 4096]], "owned": [0, 1024], "group_size": 16,
       "slice_bytes": 256}
FMT = SlotFormat(SIG, 1 << 20, "arc")
ITERS = (98, 99, 100)


def manifests(rank: int) -> dict[int, dict]:
    """Three committed slots of iterations 98-100, every region with a checksum."""
    regions = {"own": [0, 256, 11 + rank], "redundancy": [256, 256, 13 + rank],
               "owned": [512, 1024, 17 + rank], "aor": [1536, 1024, 19 + rank]}
    return {slot: {"iteration": it, "layout": SIG, "nbytes": 1 << 20, "protection": "arc",
                   "regions": regions, "aor": {"valid": True, "owner": rank + 1},
                   "checksum": "xxh3"} for slot, it in enumerate(ITERS)}


def synthetic_inventory(rank: int, lost: bool = False):
    """(this rank's inventory, its pickled size): round 1 (newest slot verified)."""
    if lost:
        return {}, len(pickle.dumps({}))
    inv = take_inventory(manifests(rank), FMT, False, lambda slot, m, region: True)
    return inv, len(pickle.dumps(inv))


def layout(world: int) -> tuple[int, int]:
    """(TP, PP) of the bench's job at ``world`` ranks: TP8, PP growing to 8 while DP
    reaches 16 (16: TP8 x DP2; 1,024: TP8 x PP8 x DP16; 16,384: x DP256)."""
    if world % 8:
        raise ValueError(f"--ranks: {world} is not a multiple of TP 8")
    pp = min(8, max(1, world // 128))
    while world % (8 * pp):
        pp //= 2
    return 8, pp


def layout_groups(world: int, tp: int, pp: int) -> list[list[int]]:
    """Megatron's order (TP fastest, then PP, then DP): the sharding (DP) groups."""
    mp = tp * pp
    return [[m + mp * d for d in range(world // mp)] for m in range(mp)]


def plan_over(world: int, tp: int, pp: int, rpn: int, dead: list[int]):
    """The plan every rank computes after losing ``dead`` (which come back empty):
    (RecoveryPlan, group index -> ranks). The inventories are made before the clock
    this returns under starts only in the caller's sense: the caller times it all."""
    one, _ = synthetic_inventory(0)
    invs = as_inventories([{} if r in dead else one for r in range(world)])
    groups = layout_groups(world, tp, pp)
    facts = JobFacts(groups, "arc", False, False, rpn)
    return plan_recovery(invs, facts, None), dict(enumerate(groups))
