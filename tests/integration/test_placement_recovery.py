"""REFT on the layouts real clusters run: several data-parallel ranks per node. Under one
torchrun, ``--reft-ranks-per-node 2`` makes ranks 0-1 node 0 and ranks 2-3 node 1 (each
node its own shared-memory directory); the placement (reft_ext/protect/placement.py)
keeps every copy on the other node. A lost node (its processes and its shared memory)
comes back from the survivors' memory, and every run ends bit-identical (state, every
logged loss, the final checkpoint) to its own failure-free run."""

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import (N, OWN, PARITY, REPLICA, assert_persistent_fallback,
                                    assert_recovered, reft)
from tests.harness.run import LAYOUTS, TINY, torchrun

NODE1_LOST = "2:5:KILL:node"  # rank 2's node: ranks 2 and 3, processes and memory
PP_DP = LAYOUTS["pp2dp2"] + ["--use-tp-pp-dp-mapping"]  # stages inside a node, DP across


def _lost_node_1(layout_args, protect):
    run = torchrun(4, TINY + N + layout_args + reft(protect, 2) +
                   ["--inject-fault", NODE1_LOST], max_restarts=1).check()
    assert "[FAULT] wiped failure domain 1" in run.output
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    return run


@pytest.mark.slow  # make test's 12 minutes; the default tier: test_zeropp.py's lost node
# (DP4 ZeRO-1 arc,aor on 2 nodes x 2, the same ring and sources, under ZeRO++)
def test_dp4_zero1_on_two_nodes_of_two_survives_a_lost_node(reference_runs):
    """DP4, ZeRO-1, arc,aor on 2 nodes x 2 ranks: the ring 0->2->1->3->0 keeps each slice
    replica and optimizer shard on the other node; node 1 lost, ranks 2 and 3 take their
    slices and shards from ranks 0 and 1."""
    layout = "dp4-zero1"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    run = _lost_node_1(LAYOUTS[layout], "arc,aor")
    assert ("[REFT] placement (2 rank(s) per node): sharding group [0, 1, 2, 3] on nodes "
            "[0, 0, 1, 1]: arc+aor copies (keeper->kept) 0->2, 2->1, 1->3, 3->0; every group "
            "alike") in run.output
    assert_recovered(run.events, 4, {0: OWN, 1: OWN, 2: REPLICA, 3: REPLICA},
                     aor_from={2: 0, 3: 1})
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # the default tier: the ZeRO-1 arc,aor case above (a superset)
@pytest.mark.parametrize("layout,protect,lost", [
    ("dp4", "arc", REPLICA),     # slices 2, 3 from the replicas on ranks 0, 1
    ("dp4", "aec", PARITY),      # parity groups [0, 2] and [1, 3]: one lost in each
    ("tp2dp2", "arc", REPLICA),  # TP inside a node, DP across: one member per node
    ("pp-dp", "arc", REPLICA),   # each node one rank of each stage (--use-tp-pp-dp-mapping)
])
def test_lost_node_with_several_ranks_per_node(layout, protect, lost, reference_runs):
    args = PP_DP if layout == "pp-dp" else LAYOUTS[layout]
    ref = reference_runs(layout, 4, TINY + N + args)
    run = _lost_node_1(args, protect)
    assert_recovered(run.events, 4, {0: OWN, 1: OWN, 2: lost, 3: lost})
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_two_lost_nodes_of_a_group_fall_back_to_persistent(tmp_path, reference_runs):
    """DP6 on 3 nodes x 2 (ring 0->2->4->1->3->5->0): nodes 0 and 1 lost take slice 2
    with its replica (kept by rank 0): beyond arc, logged, and the job continues from the
    persistent checkpoint exactly as the failure-free run."""
    args = TINY + N + ["--global-batch-size", "12"]
    ref = reference_runs("dp6", 6, args)
    save = str(tmp_path / "ckpt")
    run = torchrun(6, args + reft("arc", 2) + [
        "--save", save, "--load", save, "--save-interval", "3",
        "--inject-fault", "0:5:KILL:node,2:5:KILL:node"], max_restarts=1).check()
    assert run.output.count("[FAULT] wiped failure domain") == 2
    assert_persistent_fallback(run.events, 3, save, reason=(
        "iteration 4: sharding group [0, 1, 2, 3, 4, 5] lost the slices of ranks "
        "[0, 1, 2, 3], more than --reft-protect arc can rebuild"))
    same_as_reference(run, ref, 4)


def test_a_group_on_one_node_is_refused_before_training(monkeypatch):
    """PP2 x DP2 in megatron-core's default order on 2 nodes x 2: each data-parallel group
    lives on one node, which no placement can protect: refused by the trainer's argument
    parsing (before any process group), with the flag that fixes it; the same job with
    --use-tp-pp-dp-mapping is accepted."""
    from megatron.training.arguments import ArgumentError, parse_args

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = TINY + N + LAYOUTS["pp2dp2"] + reft("arc", None)
    with pytest.raises(ArgumentError) as exc:
        parse_args(args, world_size=4)
    assert str(exc.value).startswith(
        "--reft-protect arc: sharding group (ranks [0, 1], nodes [0, 0]) lives on one "
        "failure domain: a node loss takes every copy (--reft-ranks-per-node 2). Spread "
        "each data-parallel group over nodes: --use-tp-pp-dp-mapping"), str(exc.value)
    parse_args(args + ["--use-tp-pp-dp-mapping"], world_size=4)
