"""The reliability model against a Monte-Carlo simulation of failures, and the cost
estimator against the field examples of docs/design.md."""

import math

import numpy as np
import pytest

from reft_ext.plan import plan
from reft_ext.plan.hardware import training_days
from reft_ext.plan.reliability import (
    ReliabilityConfig,
    goodput,
    mtbf_hours,
    simulate_goodput,
    simulate_survival,
    simulate_unrecoverable,
    survival,
    unrecoverable_fraction,
)


def weibull_lambda(mtbf: float, c: float) -> float:
    return (math.gamma(1 + 1 / c) / mtbf) ** c


@pytest.mark.parametrize("c", [0.7, 1.0, 1.5])
def test_survival_without_repair_matches_monte_carlo(c):
    """The paper's Figure 8: no protection, one and two failures per group of D."""
    rng = np.random.default_rng(8)
    lam = weibull_lambda(500.0, c)
    t = np.array([5.0, 20.0, 60.0, 150.0])
    for k in (0, 1, 2):
        model = survival(t, 32, 4, k, lam, c)
        mc = simulate_survival(t, 32, 4, k, lam, c, 20000, rng)
        assert np.abs(model - mc).max() < 0.015, (k, model, mc)
    # protection only ever helps, and helps more with more failures covered
    assert (survival(t, 32, 4, 0, lam, c) <= survival(t, 32, 4, 1, lam, c)).all()
    assert (survival(t, 32, 4, 1, lam, c) <= survival(t, 32, 4, 2, lam, c)).all()


@pytest.mark.parametrize("c, k", [(0.7, 1), (1.0, 1), (1.5, 1), (0.7, 2), (1.0, 2)])
def test_unrecoverable_fraction_matches_monte_carlo(c, k):
    """With repair: a failure is fatal for memory when k more group members fail within
    the window (renewal processes, after burn-in)."""
    rng = np.random.default_rng(k * 10 + int(c * 10))
    lam = weibull_lambda(100.0, c)
    model = unrecoverable_fraction(10.0, 8, k, lam, c)
    mc = simulate_unrecoverable(8, k, lam, c, 10.0, 60000.0, 4, rng)
    assert 0.05 < model < 0.6
    assert abs(model - mc) < 0.02 + 0.05 * model, (model, mc)


@pytest.mark.parametrize("q", [1.0, 0.2, 0.0])
def test_goodput_matches_monte_carlo(q):
    """Daly's segment time (q = 1: every failure rolls back to the persistent checkpoint)
    and the two-level REFT composition (q < 1) against an event-driven simulation."""
    rng = np.random.default_rng(int(q * 10))
    rate, snap, snap_cost, r_mem, every, cost, r_persist = 0.5, 0.1, 0.004, 0.2, 2.0, 0.1, 0.5
    model = goodput(snap, snap_cost, r_mem, rate * (1 - q)) * \
        goodput(every, cost, r_persist, rate * q)
    if q == 1.0:
        model = goodput(every, cost, r_persist, rate)
        snap_cost = 0.0
    mc = simulate_goodput(rate, q, snap, snap_cost, r_mem, every, cost, r_persist,
                          20000.0, rng)
    assert abs(model - mc) < 0.015, (model, mc)


def test_field_failure_arithmetic():
    """docs/design.md: 0.1% per GPU-day -> 0.8% per 8-GPU node-day -> a 10,000-GPU job sees a
    failure on 99.99% of days."""
    cfg = ReliabilityConfig(node_failures_per_day=1 - 0.999 ** 8)
    assert math.isclose(cfg.node_failures_per_day, 0.008, rel_tol=0.01)
    p_fail = 1 - survival(24.0, 1250, 8, 0, cfg.weibull_lambda, cfg.weibull_shape)
    assert p_fail > 0.9999
    assert math.isclose(cfg.mtbf_hours, 24 / -math.log(1 - cfg.node_failures_per_day))
    assert math.isclose(mtbf_hours(cfg.weibull_lambda, 1.0), cfg.mtbf_hours)


def test_opt_goodput_needs_hours_of_downtime_per_failure():
    """OPT-175B: 992 A100 (124 nodes), ~105 restarts in ~60 days, a checkpoint every 300
    steps of ~14.4 s. The rollbacks alone cost < 5% of the time; the reported 44% goodput
    needs ~10 h of downtime per failure in Daly's model (where a failure during a restart
    starts the restart again; counting every failure as a full outage, 13.4 h lost a day /
    1.75 failures = 7.6 h each)."""
    rate = 105 / 60 / 24                     # failures per hour
    interval = 300 * 14.4 / 3600             # hours
    assert goodput(interval, 0.0, 0.0, rate) > 0.95
    assert abs(goodput(interval, 0.0, 10.6, rate) - 0.44) < 0.01
    assert abs(1 - rate * (7.0 + interval / 2) - 0.44) < 0.01  # first order


def test_cost_reproduces_field_examples():
    # 175B parameters, 10T tokens, 8192 H100 at 50% MFU: about 30 days
    assert abs(training_days(10e12, 175e9, 8192, 989e12, 0.5) - 30) < 0.5
    # OPT-175B: 300B tokens on 992 A100 at 147 TFLOP/s (47% MFU): about 25 days
    assert abs(training_days(300e9, 175e9, 992, 312e12, 147 / 312) - 25) < 0.5
    r = plan(["--num-parameters", "175e9", "--train-tokens", "10e12", "--num-gpus", "8192",
              "--hardware", "H100", "--mfu", "0.5"])
    assert r.plan is None and abs(r.cost["compute_days"] - 30) < 0.5
    assert "30.0 days of compute" in r.render()


def test_planned_job_reliability_and_wall_clock():
    r = plan(["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
              "--pipeline-model-parallel-size", "8", "--data-parallel-size", "8",
              "--hardware", "V100", "--fp16", "--train-tokens", "1e11",
              "--node-failures-per-day", "0.02", "--restart-seconds", "600"])
    rel = r.reliability
    assert (rel.nodes, rel.group, rel.k) == (64, 8, 1)
    assert 0 < rel.q < 0.01
    assert rel.interval_target["with"] > 100 * rel.interval_target["without"]
    assert rel.goodput["with"] > rel.goodput["without"]
    wall = r.cost["wall_days"]
    assert wall["with"] < wall["without"]
    assert math.isclose(wall["with"], r.cost["compute_days"] / rel.goodput["with"])
    # no protection: every failure is unrecoverable from memory
    none = plan(["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
                 "--pipeline-model-parallel-size", "8", "--data-parallel-size", "8",
                 "--hardware", "V100", "--fp16", "--reft-protect", "none"])
    assert none.reliability.k == 0 and none.reliability.q == 1.0


def test_zero1_without_aor_says_why_no_failure_is_protected():
    """ZeRO-1 under --reft-protect arc: the optimizer shards have no copy on another node,
    so the model protects no failure; the planner says why, and how to cover them."""
    args = ["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "8", "--data-parallel-size", "8",
            "--hardware", "V100", "--fp16", "--use-distributed-optimizer"]
    bare = plan(args + ["--reft-protect", "arc"])
    assert bare.reliability.k == 0 and bare.reliability.q == 1.0
    text = bare.render()
    assert "placement OK (ZeRO-1 optimizer shards unprotected: see Reliability)" in text
    assert ("Protected failures per group: 0 because the ZeRO-1 optimizer shards "
            "(--use-distributed-optimizer) have no copy on another node under --reft-protect "
            "arc: a lost node's shards are gone, so every node loss falls back to the "
            "persistent checkpoint; --reft-protect arc,aor covers them.") in text
    covered = plan(args + ["--reft-protect", "arc,aor"])
    assert covered.reliability.k == 1 and covered.reliability.why_unprotected is None
    assert "Protected failures per group: 0" not in covered.render()
