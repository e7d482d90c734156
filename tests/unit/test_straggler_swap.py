"""The pieces of --reft-replace-stragglers without a job: who is proposed, what the
supervisor takes for a swap rather than a failure, the agreement over a real gloo group,
when the swap is taken, the flag's refusals, the swap in the goodput books, a spare that
is not slow, and the capacity the supervisor publishes (signed) in a real store."""

from __future__ import annotations

import datetime
import math
import os
from types import SimpleNamespace

import pytest
import torch

from megatron.training.straggler_swap import SwapControl
from reft_ext.cluster import straggler_swap as swap
from reft_ext.cluster.inprocess import key, new_secret, sign
from reft_ext.cluster.straggler_config import StragglerConfig
from reft_ext.cluster.supervisor import listen
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.report.goodput import Ledger
from reft_ext.testing.fault_observer import FaultObserver
from reft_ext.testing.fault_specs import parse_fault_spec

EXIT = swap.EXIT_SWAPPED


def test_the_slowest_named_rank_is_proposed():
    named = {1: dict(ratio=2.0), 3: dict(ratio=3.0), 5: dict(ratio=1.8)}
    node_of = lambda r: r // 2  # noqa: E731
    assert swap.candidate(named, node_of) == (1, named[3])
    assert swap.candidate({}, node_of) is None


@pytest.mark.parametrize("codes,per_node,slots", [
    ({0: None, 1: EXIT}, 1, [1]),                     # a node of one rank left
    ({0: None, 1: None, 2: EXIT, 3: EXIT}, 2, [1]),   # a whole node of two
    ({0: None, 1: None, 2: EXIT, 3: None}, 2, None),  # half a node: not a swap
    ({0: None, 1: EXIT, 2: -9, 3: None}, 1, None),    # a crash beside it: a failure
    ({0: None, 1: None}, 1, None),                    # nobody ended
    ({0: 0, 1: EXIT}, 1, None),                       # one finished: not a swap
])
def test_the_supervisor_takes_whole_nodes_that_left_with_the_swap_code(codes, per_node,
                                                                       slots):
    assert swap.exits_are_swaps(codes, per_node) == slots


@pytest.fixture
def gloo1(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg",
                                         rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _args(every=1, iters=20):
    return SimpleNamespace(reft_snapshot_every=every, train_iters=iters)


def test_the_agreement_is_collected_later_and_the_swap_waits_for_a_snapshot(gloo1):
    """A proposal posted at an exchange is read at the next iteration; the swap comes at
    the first iteration whose snapshot is taken (every 4 here), never at the last."""
    ctl = SwapControl(_args(every=4, iters=20), per_node=2)
    ctl._capacity = lambda: 1
    ctl.after_exchange({3: dict(ratio=2.5, cost_s=0.01)}, speaks=True, iteration=5)
    assert ctl.agreement.pending
    ctl.after_exchange({3: dict(ratio=2.5)}, speaks=True, iteration=5)  # one at a time
    assert ctl.poll(6) is None and ctl.due == dict(node=1, iteration=8, agreed=6)
    assert ctl.poll(7) is None
    assert ctl.poll(8) == dict(node=1, iteration=8, agreed=6)
    ctl.restarted()
    assert ctl.due is None and not ctl.agreement.pending
    # agreed too late to take before the end: the run ends anyway
    ctl.after_exchange({3: dict(ratio=2.5)}, speaks=True, iteration=17)
    assert ctl.poll(18) is None and ctl.poll(20) is None and ctl.due is None


def test_no_spare_no_proposal_said_once(gloo1, capsys):
    ctl = SwapControl(_args(), per_node=1)
    ctl._capacity = lambda: 0
    for it in (4, 6):
        ctl.after_exchange({1: dict(ratio=3.0)}, speaks=True, iteration=it)
        assert ctl.poll(it + 1) is None and ctl.due is None
    out = capsys.readouterr().out
    assert out.count("straggler: node 1 is not swapped: the in-process supervisor has no "
                     "warm spare") == 1, out
    # a rank that does not speak for its group proposes nothing and reads no store
    ctl._capacity = lambda: pytest.fail("only the group's first rank asks")
    ctl.after_exchange({1: dict(ratio=3.0)}, speaks=False, iteration=8)
    assert ctl.poll(9) is None


def test_the_flag_is_refused_where_no_swap_can_be_safe():
    cfg = StragglerConfig(replace_stragglers=True)
    arc = ReftConfig(snapshot_every=1, protect="arc")
    assert "--reft-restart in-process" in cfg.swap_problem(arc, False, True)
    assert "in-process supervisor" in cfg.swap_problem(arc, True, False)
    assert "last copy" in cfg.swap_problem(ReftConfig(snapshot_every=1), True, True)
    assert "last copy" in cfg.swap_problem(ReftConfig(protect="none"), True, True)
    assert cfg.swap_problem(arc, True, True) is None
    assert StragglerConfig().swap_problem(ReftConfig(), False, False) is None
    with pytest.raises(ReftConfigError, match="--reft-replace-stragglers: needs straggler"):
        StragglerConfig(replace_stragglers=True, straggler_interval=0)


def test_a_swap_is_booked_as_a_swap_in_both_processes():
    t = 1000.0
    led = Ledger(t)
    led.switch("productive", now=t + 1)
    led.failed(planned=True)
    assert led.swaps == 1 and led.failures == 0
    rec = led.record(run="r", iteration=8, swapped_out=True)
    nxt = Ledger(rec["time"] + 0.5)  # the spare's process goes on from the leaver's books
    nxt.carry(rec, restored=8)
    assert nxt.swaps == 2 and nxt.failures == 0  # the leaver's own swap, and this one
    plain = Ledger(rec["time"] + 0.5)
    plain.carry(dict(rec, swapped_out=False), restored=8)
    assert plain.failures == 1 and plain.swaps == 1


def test_a_replacement_process_is_not_slow(monkeypatch):
    spec = parse_fault_spec("1:3:CONT:slow:4")
    monkeypatch.setenv("REFT_GENERATION", "0")
    assert FaultObserver([spec], 1).slow_factor(5) == 4
    monkeypatch.setenv("REFT_GENERATION", "1")  # a spare given the rank in generation 1
    assert FaultObserver([spec], 1).slow_factor(5) is None


def test_the_capacity_is_read_only_when_signed():
    secret = bytes.fromhex(new_secret())
    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False,
                   timeout=datetime.timedelta(seconds=5))
    assert swap.read_capacity(store, secret) == 0
    swap.publish_capacity(store, secret, 2, gen=3)
    assert swap.read_capacity(store, secret) == 2
    store.set(key(swap.CAPACITY), sign(os.urandom(32), key(swap.CAPACITY), "9", 3))
    assert swap.read_capacity(store, secret) == 0  # forged: no spare assumed


def test_the_swap_line_with_and_without_the_detectors_figures():
    info = dict(ratio=3.0, cost_s=0.0656)
    full = swap.swap_text(1, [2, 3], info, 8, 16)
    assert full.startswith("straggler swap: node 1 (ranks 2-3, 3.00x the other ranks' "
                           "median) leaves after iteration 8's snapshot")
    assert full.endswith("It cost the job 65.6 ms per iteration: 1.0 s over the 16 "
                         "iteration(s) left")
    bare = swap.swap_text(1, [2, 3], None, 8, 16)  # another group named the node
    assert bare == ("straggler swap: node 1 (ranks 2-3) leaves after iteration 8's "
                    "snapshot, committed on every rank; a warm spare takes its place")
    assert swap.swap_text(1, [1], None, 8, 16).startswith("straggler swap: node 1 (rank 1) ")


def test_swap_benchmark_medians_of_no_data_print_a_dash():
    """A swap taken right after --slow-from (or too near --iters) leaves no iteration to
    take a median of: '-', not a StatisticsError."""
    from benchmarks.bench_straggler_swap import gaps, median, ms

    assert gaps({5: 1.0, 6: 1.5}, 6, 6) == [] and math.isnan(median([]))
    assert ms(median([])) == "       -" and ms(median([0.25, 0.5])) == "   375.0"
