"""Placement across failure domains (reft_ext/protect/placement.py) over many layouts:
megatron-core's own data-parallel groups (its RankGenerator, not our formula), every
ranks-per-node that divides the world, both rank orders. Properties: no holder shares a
failure domain with what it protects; every slice is covered exactly once per scheme; the
loss of any one failure domain is recoverable, bit for bit, by ARC and AEC; what cannot
be placed is refused with the flag that fixes it."""

from __future__ import annotations

import itertools

import pytest
import torch

from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.protect.placement import (check_placement, megatron_dp_groups, place,
                                        placement_problem)
from reft_ext.protect.schemes import make_protection
from reft_ext.state.layout import StateLayout

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")


def _layouts():
    """(world, tp, pp, order, ranks per node) of jobs up to 32 ranks."""
    for world in (4, 8, 12, 16, 32):
        for tp, pp in itertools.product((1, 2, 4), (1, 2, 4)):
            if world % (tp * pp) or world // (tp * pp) < 2:
                continue
            for order in ORDERS:
                for rpn in (1, 2, 4, 8):
                    if world % rpn == 0:
                        yield world, tp, pp, order, rpn


LAYOUTS = list(_layouts())


def _megatron_groups(world, tp, pp, order):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    return gen.get_ranks("dp")


@pytest.mark.parametrize("world,tp,pp,order", sorted({x[:4] for x in LAYOUTS}))
def test_groups_are_megatron_cores(world, tp, pp, order):
    got = megatron_dp_groups(world, tp, pp, order=order)
    assert sorted(map(sorted, got)) == sorted(map(sorted, _megatron_groups(world, tp, pp, order)))


def test_every_layout_is_placed_across_domains_or_refused():
    placed = refused = 0
    for world, tp, pp, order, rpn in LAYOUTS:
        for group in megatron_dp_groups(world, tp, pp, order=order):
            p = place(group, rpn)
            domains = {r // rpn for r in group}
            why = placement_problem(group, rpn, "arc")
            counts = [sum(r // rpn == n for r in group) for n in domains]
            if len(domains) < 2:  # the whole group on one node: nothing can protect it
                assert why and "lives on one failure domain" in why
                refused += 1
                continue
            if 2 * max(counts) > len(group):  # e.g. 12 ranks, PP2, nodes of 4: 4 + 2
                assert "more than half its members on one failure domain" in why
                refused += 1
                continue
            assert why is None, (world, tp, pp, order, rpn, group)
            placed += 1
            D = len(group)
            # ARC / AOR: the ring is a permutation; each member's copy on another node
            assert sorted(p.ring) == list(range(D))
            assert sorted(p.protects(d) for d in range(D)) == list(range(D))
            for d in range(D):
                assert p.domains[p.protects(d)] != p.domains[d]
                assert p.holder(p.protects(d)) == d
            # AEC: parity groups partition the members, one member per domain each
            members = [m for g in p.parity_groups for m in g]
            assert sorted(members) == list(range(D))
            for g in p.parity_groups:
                assert len(g) == len(domains) >= 2
                assert len({p.domains[m] for m in g}) == len(g)
            if len(domains) == D:  # one member per node: REFT's original layout
                assert p.ring == tuple(range(D)) and p.parity_groups == (tuple(range(D)),)
    assert placed > 100 and refused > 10  # both branches really exercised


def _state(D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(4 * D * 37 + 5, generator=g)), ("b", torch.randn(11, generator=g))]


@pytest.mark.parametrize("scheme", ["arc", "aec"])
@pytest.mark.parametrize("ranks,rpn", [
    ([0, 1, 2, 3], 2),            # DP4 on 2 nodes x 2
    ([0, 2, 4, 6], 4),            # TP2 x DP4 on 2 nodes of 4
    (list(range(8)), 2),          # DP8 on 4 nodes x 2
    (list(range(6)), 2),          # DP6 on 3 nodes x 2
    (list(range(8)), 4),          # DP8 on 2 nodes x 4
    ([0, 1, 2], 1)])              # one member per node
def test_any_one_lost_domain_comes_back_bit_for_bit(scheme, ranks, rpn):
    p = place(ranks, rpn)
    D = len(ranks)
    prot = make_protection(scheme, p)
    state = _state(D, D * 7 + rpn)
    lays = [StateLayout(state, [], D, m, prot.sub_blocks()) for m in range(D)]
    L = lays[0].slice_bytes
    slices, red = {}, {}
    for m, lay in enumerate(lays):
        slices[m] = torch.empty(L, dtype=torch.uint8)
        lay.replicated.read(m * L, (m + 1) * L, slices[m])
        red[m] = torch.empty(prot.redundancy_bytes(lay), dtype=torch.uint8)
        prot.encode(lay, red[m])
    for node in sorted(set(p.domains)):
        lost = [m for m in range(D) if p.domains[m] == node]
        ok = [m not in lost for m in range(D)]
        plan = prot.plan(ok, ok)
        assert plan is not None, (node, lost)
        have = {m: t for m, t in slices.items() if m not in lost}
        parity = {m: t for m, t in red.items() if m not in lost}
        for m in lost:
            assert plan[m] != "own" and set(prot.sources(m)).isdisjoint(lost)
            out = torch.zeros(L, dtype=torch.uint8)
            prot.recover(m, have, parity, out)
            assert torch.equal(out, slices[m]), (scheme, node, m)


def test_two_lost_domains_of_one_group_are_beyond_protection():
    """DP4 on 2 nodes x 2: losing both nodes loses every copy; DP8 on 4 nodes x 2:
    losing two neighbouring nodes of the ring takes a slice and its replica."""
    for ranks, rpn, nodes in (([0, 1, 2, 3], 2, (0, 1)), (list(range(8)), 2, (0, 1))):
        p = place(ranks, rpn)
        for scheme in ("arc", "aec"):
            ok = [p.domains[m] not in nodes for m in range(len(ranks))]
            assert make_protection(scheme, p).plan(ok, ok) is None, (scheme, ranks)


def test_refusals_name_the_group_and_the_flags():
    cfg = ReftConfig(snapshot_every=1, protect="arc,aor", ranks_per_node=2)
    groups = megatron_dp_groups(4, 1, 2)  # PP2 x DP2: each group inside one node
    with pytest.raises(ReftConfigError) as exc:
        check_placement(cfg, 4, groups)
    msg = str(exc.value)
    assert msg.startswith("--reft-protect arc,aor: sharding group (ranks [0, 1], nodes "
                          "[0, 0]) lives on one failure domain") and \
        "--use-tp-pp-dp-mapping" in msg and "--reft-ranks-per-node 2" in msg
    check_placement(cfg, 4, megatron_dp_groups(4, 1, 2, order="tp-cp-ep-pp-dp"))
    # an uneven spread: arc places it (the fullest node on every other seat), aec not
    group = [0, 1, 4, 8]  # nodes of 4: 2 + 1 + 1 members
    p = place(group, 4)
    assert placement_problem(group, 4, "arc") is None
    assert all(p.domains[d] != p.domains[p.protects(d)] for d in range(4))
    why = placement_problem(group, 4, "aec")
    assert "unequal numbers of members per failure domain" in why and \
        "--reft-protect arc can place it" in why
    assert "more than half" in placement_problem([0, 1, 2, 4], 4, "arc")
    # protection none needs no placement
    check_placement(ReftConfig(snapshot_every=1, protect="none", ranks_per_node=4), 4,
                    [[0, 1, 2, 3]])


def test_describe_says_who_keeps_what():
    p = place([0, 1, 2, 3], 2)
    assert p.describe("arc") == [
        "rank 0 (node 0): slice 0, replica of rank 2",
        "rank 1 (node 0): slice 1, replica of rank 3",
        "rank 2 (node 1): slice 2, replica of rank 1",
        "rank 3 (node 1): slice 3, replica of rank 0"]
    assert p.describe("aec")[0] == "rank 0 (node 0): slice 0, AEC parity over ranks [2]"
