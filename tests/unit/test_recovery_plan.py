"""REFT-load's decisions without torchrun: the plan (reft_ext/load/planning.py) over fake
all-gathered inventories for every protection scheme and loss pattern, the inventory a
rank takes of fake manifests (reft_ext/load/inventory.py), and the typed errors
(reft_ext/load/errors.py). Every expected plan is written out by hand from the rules in
docs/reft.md (ARC: member d-1 holds slice d; AEC: any one slice from the others'
parities; AOR: member d-1 holds member d's optimizer shard), not computed by the code
under test. The end-to-end runs of the same cases are in tests/integration/
(test_reft_recovery.py, test_aor_recovery.py, test_nodes.py)."""

from __future__ import annotations

import pytest

from reft_ext.load.errors import (BeyondProtection, MissingHandover, MixedOldGroups,
                                  NoCommonIteration, NoMetadataSource, NoRestorableIteration,
                                  NoSnapshot, OtherWorldSize, OwnedStateLost,
                                  PersistentIsNewer, RecoveryError, SlicesLeft, Unrestorable)
from reft_ext.load.inventory import Held, SlotFormat, take_inventory, take_offer
from reft_ext.load.planning import (GroupPlan, JobFacts, choose_iteration, needs_full_verify,
                                    other_world_size, plan_recovery, plan_reshard,
                                    recovery_tier)
from reft_ext.state.regions import Region, Source

OWN, REPLICA, PARITY = Source.OWN, Source.REPLICA, Source.PARITY
R_OWN, R_RED = Region.OWN, Region.REDUNDANCY

# 6 ranks on 3 nodes of 2 (node n: ranks 2n, 2n+1), tensor-parallel 2: two sharding
# groups of D = 3, so a lost node takes one member of each group
GROUPS = [[0, 2, 4], [1, 3, 5]]
NODE = {0: (0, 1), 1: (2, 3), 2: (4, 5)}


def held(slot, own=True, red=True, owned=True, aor=False, aor_owner=None):
    return Held(slot, {Region.OWN: own, Region.REDUNDANCY: red, Region.OWNED: owned,
                       Region.AOR: aor}, aor_owner)


def verified(iterations=(8, 10), aor_owner=None):
    """A rank's round-2 inventory: every region of both slots verified (iteration 8 in
    slot 0, 10 in slot 1); with ``aor_owner`` its AOR replica (of that rank) too."""
    return {it: held(slot, aor=aor_owner is not None, aor_owner=aor_owner)
            for slot, it in enumerate(iterations)}


def job(lost_nodes=(), aor=False, iterations=(8, 10)):
    """Inventories after a restart that replaced ``lost_nodes`` (fresh memory: empty)."""
    lost = {r for n in lost_nodes for r in NODE[n]}
    owner = {0: 2, 2: 4, 4: 0, 1: 3, 3: 5, 5: 1}  # member d-1 holds member d's shard
    return [{} if r in lost else verified(iterations, owner[r] if aor else None)
            for r in range(6)]


def facts(scheme, owned=False, aor=False, groups=GROUPS):
    return JobFacts(groups, scheme, owned, aor)


def all_own(ranks, owned_from=None):
    """Every member restores its own slice and sends it to the two others (every member
    writes the whole replicated state)."""
    return GroupPlan(ranks, {0: OWN, 1: OWN, 2: OWN}, owned_from or {}, None,
                     [{0: R_OWN}, {1: R_OWN}, {2: R_OWN}],
                     [(0, 0, 1), (0, 0, 2), (1, 1, 0), (1, 1, 2), (2, 2, 0), (2, 2, 1)], [])


# ---- nothing lost / a crash that left memory intact: every rank from its own memory ----
@pytest.mark.parametrize("scheme", ["none", "arc", "aec"])
def test_nothing_lost_is_own_memory(scheme):
    plan = plan_recovery(job(), facts(scheme), persistent=None)
    assert plan.iteration == 10 and plan.tier == "own memory"
    if scheme == "arc":  # each member also holds its verified replica of the next slice
        held_ = [{0: R_OWN, 1: R_RED}, {1: R_OWN, 2: R_RED}, {2: R_OWN, 0: R_RED}]
        want = {gi: GroupPlan(GROUPS[gi], {0: OWN, 1: OWN, 2: OWN}, {}, None, held_,
                              [(0, 0, 1), (1, 1, 2), (2, 2, 0)], []) for gi in (0, 1)}
    else:
        want = {0: all_own([0, 2, 4]), 1: all_own([1, 3, 5])}
    assert plan.groups == want


def test_a_crashed_rank_with_memory_intact_reloads_its_own_snapshot():
    """Rank 3 crashed, its node (and /dev/shm) survived: its inventory is whole."""
    invs = job()
    plan = plan_recovery(invs, facts("none", owned=True), persistent=None)
    assert plan.iteration == 10 and plan.tier == "own memory"
    assert plan.groups[1] == all_own([1, 3, 5], {1: 1, 3: 3, 5: 5})


# ---- one node lost: one member of each group rebuilt ------------------------------------
def test_arc_one_node_lost_from_the_replica_on_the_previous_member():
    plan = plan_recovery(job(lost_nodes=[1]), facts("arc"), persistent=None)
    assert plan.iteration == 10 and plan.tier == "ARC replica"
    # member 1 (ranks 2 / 3) lost; member 0 holds its replica and sends it to members 1
    # and 2; member 2 holds replica 0; the replacement member 1 receives slices 0 and 2
    want = {gi: GroupPlan(GROUPS[gi], {0: OWN, 1: REPLICA, 2: OWN}, {}, 0,
                          [{0: R_OWN, 1: R_RED}, {}, {2: R_OWN, 0: R_RED}],
                          [(0, 0, 1), (1, 0, 1), (1, 0, 2), (2, 2, 0), (2, 2, 1)], [])
            for gi in (0, 1)}
    assert plan.groups == want
    assert plan.groups[0].meta_source(1) == 0 and plan.groups[0].meta_source(2) == 2


def test_aec_one_node_lost_from_the_parities_of_the_others():
    plan = plan_recovery(job(lost_nodes=[2]), facts("aec"), persistent=None)
    assert plan.iteration == 10 and plan.tier == "AEC parity"
    want = {gi: GroupPlan(GROUPS[gi], {0: OWN, 1: OWN, 2: PARITY}, {}, 0,
                          [{0: R_OWN}, {1: R_OWN}, {}],
                          [(0, 0, 1), (0, 0, 2), (1, 1, 0), (1, 1, 2)], [(2, [0, 1])])
            for gi in (0, 1)}
    assert plan.groups == want


def test_arc_with_aor_rebuilds_the_lost_zero1_shard_from_its_holder():
    plan = plan_recovery(job(lost_nodes=[1], aor=True), facts("arc", owned=True, aor=True),
                         persistent=None)
    assert plan.iteration == 10 and plan.tier == "ARC replica + AOR replica"
    assert plan.groups[0].owned_from == {0: 0, 2: 0, 4: 4}
    assert plan.groups[1].owned_from == {1: 1, 3: 1, 5: 5}
    assert plan.groups[0].aor_sends == [(0, 2)] and plan.groups[1].aor_sends == [(1, 3)]


def test_aec_with_aor():
    plan = plan_recovery(job(lost_nodes=[0], aor=True), facts("aec", owned=True, aor=True),
                         persistent=None)
    assert plan.tier == "AEC parity + AOR replica"
    assert plan.groups[0].slices == {0: PARITY, 1: OWN, 2: OWN}
    assert plan.groups[0].rebuild == [(0, [1, 2])] and plan.groups[0].meta_from == 1
    # member 2 (rank 4) holds member 0's shard (rank 0)
    assert plan.groups[0].owned_from == {0: 4, 2: 2, 4: 4}
    assert plan.groups[0].aor_sends == [(4, 0)]


def test_zero1_without_aor_cannot_rebuild_a_lost_shard():
    with pytest.raises(NoRestorableIteration) as e:
        plan_recovery(job(lost_nodes=[1]), facts("arc", owned=True), persistent=None)
    why = "ranks [2] lost their ZeRO-1 optimizer shards (no host replica without " \
          "--reft-protect aor)"
    assert str(e.value) == f"iteration 10: {why}; iteration 8: {why}"
    assert list(e.value.skipped) == [10, 8]
    assert isinstance(e.value.skipped[10], OwnedStateLost) and e.value.skipped[10].lost == [2]


def test_none_loses_any_slice():
    with pytest.raises(NoRestorableIteration) as e:
        plan_recovery(job(lost_nodes=[1]), facts("none"), persistent=None)
    why = "sharding group [0, 2, 4] lost the slices of ranks [2], more than " \
          "--reft-protect none can rebuild"
    assert str(e.value) == f"iteration 10: {why}; iteration 8: {why}"
    assert isinstance(e.value, RecoveryError)


# ---- beyond protection: two nodes of one group ------------------------------------------
@pytest.mark.parametrize("scheme", ["arc", "aec"])
def test_two_nodes_lost_in_one_group_is_beyond_protection(scheme):
    with pytest.raises(NoRestorableIteration) as e:
        plan_recovery(job(lost_nodes=[1, 2]), facts(scheme), persistent=12)
    first = e.value.skipped[10]
    assert isinstance(first, BeyondProtection)
    assert (first.ranks, first.lost, first.scheme) == ([0, 2, 4], [2, 4], scheme)
    assert str(e.value).startswith(f"iteration 10: sharding group [0, 2, 4] lost the slices "
                                   f"of ranks [2, 4], more than --reft-protect {scheme} can "
                                   f"rebuild; iteration 8: ")


def test_arc_survives_two_losses_that_are_not_neighbours():
    """ARC, D = 4: members 0 and 2 lost, their holders (3 and 1) survived."""
    invs = [{} if r in (0, 2) else verified() for r in range(4)]
    plan = plan_recovery(invs, facts("arc", groups=[[0, 1, 2, 3]]), persistent=None)
    assert plan.groups[0].slices == {0: REPLICA, 1: OWN, 2: REPLICA, 3: OWN}
    assert plan.groups[0].meta_from == 1


def test_every_slice_rebuilt_leaves_no_metadata_source():
    """Both own slices fail their checksum, both replicas verify: the slices can be
    rebuilt but no member's own snapshot is trusted for the metadata."""
    invs = [{10: held(0, own=False)}, {10: held(0, own=False)}]
    with pytest.raises(NoRestorableIteration) as e:
        plan_recovery(invs, facts("arc", groups=[[0, 1]]), persistent=None)
    assert isinstance(e.value.skipped[10], NoMetadataSource)


# ---- which iteration -------------------------------------------------------------------
def test_torn_newest_slot_falls_back_to_the_previous_iteration():
    """Rank 2's slot of iteration 10 is torn (its manifest is gone): without protection
    iteration 8 is the newest every group has; with ARC its replica still serves 10."""
    invs = job()
    invs[2] = {8: held(0)}
    plan = plan_recovery(invs, facts("none"), persistent=None)
    assert plan.iteration == 8 and plan.groups == {0: all_own([0, 2, 4]),
                                                  1: all_own([1, 3, 5])}
    plan = plan_recovery(invs, facts("arc"), persistent=None)
    assert plan.iteration == 10 and plan.groups[0].slices == {0: OWN, 1: REPLICA, 2: OWN}


def test_a_newer_persistent_checkpoint_wins():
    with pytest.raises(PersistentIsNewer) as e:
        plan_recovery(job(), facts("arc"), persistent=12)
    assert str(e.value) == ("the persistent checkpoint (iteration 12) is newer than host "
                            "memory (iteration 10)")
    assert plan_recovery(job(), facts("arc"), persistent=10).iteration == 10  # a tie: memory
    # 10 unrestorable, 8 restorable, persistent 9: the persistent one, saying why not 10
    invs = job()
    invs[2] = {8: held(0)}
    with pytest.raises(PersistentIsNewer) as e:
        plan_recovery(invs, facts("none"), persistent=9)
    assert (e.value.persistent, e.value.iteration) == (9, 8)
    assert str(e.value) == ("the persistent checkpoint (iteration 9) is newer than host "
                            "memory (iteration 8); iteration 10: sharding group [0, 2, 4] "
                            "lost the slices of ranks [2], more than --reft-protect none "
                            "can rebuild")


def test_max_iteration_and_empty_memory():
    assert plan_recovery(job(), facts("arc"), None, max_iteration=9).iteration == 8
    with pytest.raises(NoSnapshot, match="^no snapshot in host memory$"):
        plan_recovery([{}] * 6, facts("arc"), persistent=None)
    with pytest.raises(NoSnapshot):
        plan_recovery(job(), facts("arc"), None, max_iteration=7)


def test_choose_iteration_is_newest_first():
    def plan_one(it):
        if it > 5:
            raise Unrestorable(f"too new ({it})")
        return f"plan {it}"
    assert choose_iteration({3, 7, 5, 9}, plan_one, None) == (5, "plan 5")
    with pytest.raises(PersistentIsNewer, match=r"\(iteration 5\); iteration 9: too new "
                                                r"\(9\); iteration 7: too new \(7\)$"):
        choose_iteration([3, 7, 5, 9], plan_one, 6)
    with pytest.raises(PersistentIsNewer, match=r"\(iteration 5\)$"):
        choose_iteration([3, 7, 5, 9], plan_one, 6, cite_skipped=False)


# ---- round 1 / round 2 ----------------------------------------------------------------------
def test_round_one_leaves_aec_parity_unverified_so_a_loss_needs_round_two():
    round1 = job(lost_nodes=[2])
    for inv in round1:
        for e in inv.values():
            e.ok[Region.REDUNDANCY] = None  # AEC parity is read only when a slice is lost
    with pytest.raises(NoRestorableIteration):
        plan_recovery(round1, facts("aec"), persistent=None)
    assert needs_full_verify(round1, None)
    assert not needs_full_verify(job(lost_nodes=[2]), None)  # all verified: final


def test_round_one_is_final_when_every_rank_restores_its_verified_own_slice():
    invs = job()
    for inv in invs:
        inv[8] = held(0, None, None, None, None)  # the older slot, not verified
    plan = plan_recovery(invs, facts("arc"), persistent=None)
    assert plan.iteration == 10 and not needs_full_verify(invs, plan)
    invs = job(lost_nodes=[1])
    invs[0][8] = held(0, None, None, None, None)
    assert needs_full_verify(invs, plan_recovery(invs, facts("arc"), None))  # rebuilt


def test_recovery_tier_takes_the_plain_dict_inventories():
    inv = {7: {"slot": 0, "ok": {"own": True, "redundancy": True, "owned": False,
                                 "aor": False}, "aor_owner": None}}
    invs = [inv, inv, {7: {"slot": 0, "ok": {"own": True, "redundancy": True, "owned": False,
                                             "aor": True}, "aor_owner": 0}}]
    assert recovery_tier(invs, [[0, 1, 2]], 7, {0: {0: "own"}}, owned_needed=True) == \
        "AOR replica"


def test_other_world_size():
    e = other_world_size({(8, 4)}, 6, 3)
    assert isinstance(e, OtherWorldSize) and str(e) == (
        "host memory holds snapshots of a job of 8 ranks (data-parallel size 4), this job "
        "has 6 ranks (data-parallel size 3): REFT-load does not reshard snapshots to "
        "another data-parallel size")
    assert other_world_size({(8, 4), (6, 3)}, 6, 3) is None
    assert other_world_size(set(), 6, 3) is None


# ---- a rank's inventory of its fake slots ----------------------------------------------------
SIG = {"replicated": [["w"], 96], "owned": [[], 0], "group_size": 3, "member": 1,
       "slice_bytes": 32}


def manifest(it, scheme="arc", nbytes=96, aor=None):
    m = {"iteration": it, "layout": SIG, "nbytes": nbytes, "protection": scheme,
         "regions": {"own": [0, 32, 1], "redundancy": [32, 32, 2], "owned": [64, 0, 3],
                     "aor": [64, 32, 4]}}
    if aor is not None:
        m["aor"] = aor
    return m


def inventory(manifests, scheme="arc", verify_all=False, **kw):
    calls = []

    def verify(slot, m, region):
        calls.append((slot, region))
        return region != Region.OWNED or slot != 0  # slot 0's owned state is corrupt

    inv = take_inventory(manifests, SlotFormat(SIG, 96, scheme), verify_all, verify, **kw)
    return {it: (e.slot, dict(e.ok), e.aor_owner) for it, e in inv.items()}, calls


def test_round_one_verifies_only_what_a_recovery_without_losses_reads():
    mans = {0: manifest(8), 1: manifest(10)}
    inv, calls = inventory(mans)
    assert calls == [(1, R_OWN), (1, R_RED), (1, Region.OWNED)]
    assert inv == {10: (1, {R_OWN: True, R_RED: True, Region.OWNED: True,
                            Region.AOR: False}, None),
                   8: (0, {R_OWN: None, R_RED: None, Region.OWNED: None,
                           Region.AOR: False}, None)}
    inv, calls = inventory({0: manifest(8, "aec"), 1: manifest(10, "aec")}, "aec")
    assert calls == [(1, R_OWN), (1, Region.OWNED)] and inv[10][1][R_RED] is None
    inv, _ = inventory(mans, verify_all=True)
    assert inv[8][1] == {R_OWN: True, R_RED: True, Region.OWNED: False, Region.AOR: False}


def test_a_slot_of_another_layout_is_unusable_and_aor_is_read_in_round_two():
    inv, calls = inventory({0: manifest(10, nbytes=64)})
    assert calls == [] and set(inv[10][1].values()) == {False}
    aor = {"owner": 2, "valid": True}
    inv, calls = inventory({1: manifest(10, aor=aor)})
    assert inv[10][1][Region.AOR] is None and inv[10][2] == 2
    inv, calls = inventory({1: manifest(10, aor=aor)}, verify_all=True)
    assert inv[10][1][Region.AOR] is True and (1, Region.AOR) in calls
    inv, _ = inventory({1: manifest(10, aor={"owner": 2, "valid": False})}, verify_all=True)
    assert inv[10][1][Region.AOR] is False  # a replica that failed its own verification


def test_round_one_takes_the_fused_verdicts_of_the_newest_committed_slot():
    fused, seen = {}, []

    def fuse(slot, m):
        seen.append(slot)
        return {R_OWN: True, Region.OWNED: False}

    mans = {0: manifest(8, "aec"), 1: manifest(10, "aec")}
    inv, calls = inventory(mans, "aec", fuse=fuse, fused=fused, max_iteration=8)
    assert seen == [0] and fused == {R_OWN: (0, True), Region.OWNED: (0, False)}
    assert inv[8][1] == {R_OWN: True, R_RED: None, Region.OWNED: False, Region.AOR: False}
    assert (0, R_OWN) not in calls and (0, Region.OWNED) not in calls


def test_inventory_carries_the_writers_checksums_to_the_receivers():
    """Every region's recorded checksum travels with the inventory (all-gathered), so a
    rank receiving those bytes from this one can check them (reft_ext/load/received.py)."""
    inv = take_inventory({1: manifest(10)}, SlotFormat(SIG, 96, "arc"), False,
                         lambda *a: True)
    assert inv[10].sums == {R_OWN: 1, R_RED: 2, Region.OWNED: 3, Region.AOR: 4}
    assert inv[10].algorithm == "crc32"
    plain = {"slot": 1, "ok": {"own": True}, "aor_owner": None,
             "sums": {"own": 7}, "algorithm": "xxh3_64/4M"}
    assert Held.of(plain) == Held(1, {R_OWN: True}, None, {R_OWN: 7}, "xxh3_64/4M")
    # a slot of another layout is unusable: nothing to check against
    inv = take_inventory({1: manifest(10, nbytes=64)}, SlotFormat(SIG, 96, "arc"), False,
                         lambda *a: True)
    assert inv[10].sums == {}


def test_two_slots_of_one_iteration_keep_the_first():
    inv, _ = inventory({0: manifest(10), 1: manifest(10)}, verify_all=True)
    assert list(inv) == [10] and inv[10][0] == 0


# ---- after a shrink: the survivors' offers ---------------------------------------------------
def offer_manifest(it, member, scheme, D=3, owned=0):
    sig = dict(SIG, group_size=D, member=member, owned=[[], owned])
    return {"iteration": it, "world_size": 6, "rank": 2, "member": member, "dp_ranks": [0, 2, 4],
            "layout": sig, "protection": scheme,
            "regions": {"own": [0, 32, 11], "redundancy": [32, 32, 12], "owned": [64, 0, 13],
                        "aor": [64, 0, 14]}, "checksum": "xxh3_64/4M"}


@pytest.mark.parametrize("scheme,D,have", [
    ("arc", 3, {1: R_OWN, 2: R_RED}), ("aec", 3, {1: R_OWN}), ("aec", 2, {1: R_OWN, 0: R_RED}),
    ("none", 3, {1: R_OWN})])
def test_offer_names_the_old_slices_a_survivor_holds(scheme, D, have):
    note = {"rank": 2, "node": 1, "world_size": 6}
    o = take_offer({0: offer_manifest(4, 1, scheme, D)}, note, SIG["replicated"], 0,
                   lambda slot, m, r: True)
    assert o.old_rank == 2 and o.why == "" and o.iters[4].have == have
    assert o.iters[4].old_group == [0, 2, 4] and o.iters[4].slice == 32
    # each held old slice with the checksum its writer recorded (reshard.py checks it)
    assert o.iters[4].sums == {j: {R_OWN: 11, R_RED: 12}[r] for j, r in have.items()}
    assert o.iters[4].algorithm == "xxh3_64/4M"


def test_offer_of_zero1_state_or_another_model_is_empty_with_a_reason():
    note = {"rank": 2, "node": 1, "world_size": 6}
    o = take_offer({0: offer_manifest(4, 1, "arc", owned=64)}, note, SIG["replicated"], 0,
                   lambda *a: True)
    assert o.iters == {} and o.why.startswith("ZeRO-1 optimizer shards")
    o = take_offer({0: offer_manifest(4, 1, "arc")}, note, [["v"], 96], 0, lambda *a: True)
    assert o.iters == {} and o.why.startswith("the replicated state (params, optimizer)")
    with pytest.raises(NoCommonIteration, match=r"^the replicated state"):
        plan_reshard([o, o], [[0, 1]], None)
    with pytest.raises(MissingHandover):
        plan_reshard([None, o], [[0, 1]], None)


def _offer(old_rank, have, old_group=(0, 2, 4), iters=(4,), protection="arc"):
    return {"old_rank": old_rank, "why": "", "iters": {it: {
        "slot": 0, "old_group": list(old_group), "D": 3, "slice": 32, "have": have,
        "protection": protection} for it in iters}}


def test_reshard_plan():
    """Old group [0, 2, 4], old rank 2 excluded: 0 holds slices 0 and 1, 4 holds 2 and 0."""
    survivors = [_offer(0, {0: "own", 1: "redundancy"}), _offer(4, {2: "own", 0: "redundancy"})]
    assert plan_reshard(survivors, [[0, 1]], None) == (4, {0: [0, 0, 1]})
    with pytest.raises(NoRestorableIteration) as e:
        plan_reshard([_offer(0, {0: "own"}), _offer(4, {2: "own"})], [[0, 1]], None)
    assert isinstance(e.value.skipped[4], SlicesLeft) and e.value.skipped[4].lost == [2]
    with pytest.raises(NoRestorableIteration) as e:
        plan_reshard([survivors[0], _offer(5, {2: "own"}, old_group=(1, 3, 5))], [[0, 1]],
                     None)
    assert isinstance(e.value.skipped[4], MixedOldGroups)
    with pytest.raises(NoCommonIteration, match="^the survivors hold no common iteration"):
        plan_reshard([survivors[0], _offer(4, {2: "own"}, iters=(6,))], [[0, 1]], None)


def test_each_checksum_failure_of_the_restored_slot_is_named_with_what_served_it():
    """Rank 1's own slice of iteration 10 (imported from a flushed file) and its ZeRO-1
    shard failed their checksums: the plan takes the slice from rank 0's ARC replica and
    the shard from rank 0's AOR replica; one line each names the file and the tier. A
    failure in an older slot (not restored) says nothing."""
    from reft_ext.load.repairs import repair_lines

    invs = [verified(aor_owner=1), verified(), verified()]
    invs[1][10] = Held(1, {Region.OWN: False, Region.REDUNDANCY: True, Region.OWNED: False,
                           Region.AOR: False}, None)
    plan = plan_recovery(invs, JobFacts([[0, 1, 2]], "arc", owned_needed=True, aor=True),
                         None)
    g = plan.groups[0]
    assert (plan.iteration, g.slices[1], g.owned_from[1]) == (10, REPLICA, 0)
    manifests = {0: {"iteration": 8}, 1: {"iteration": 10, "checksum": "xxh3"}}
    files = {0: "/dev/shm/j/rank1.slot0.bin", 1: "/f/rank1.slot1.bin (flushed; imported "
             "into host memory)"}
    lines = repair_lines(1, 10, g, {(1, Region.OWN), (1, Region.OWNED), (0, Region.OWN)},
                         manifests, files)
    assert lines == [
        "rank 1: /f/rank1.slot1.bin (flushed; imported into host memory) failed its xxh3 "
        "checksum in its slice of the parameters and replicated optimizer state (own "
        "region, iteration 10): rebuilt from the ARC replica on rank 0",
        "rank 1: /f/rank1.slot1.bin (flushed; imported into host memory) failed its xxh3 "
        "checksum in its ZeRO-1 optimizer shard (owned region, iteration 10): restored "
        "from the AOR replica on rank 0"]
