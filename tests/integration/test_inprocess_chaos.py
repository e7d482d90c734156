"""A seeded in-process chaos campaign (`make test-all`): jobs under the in-process launcher
with warm spares, each hit by kills at random moments, start-up and rejoin among them
(the phases data, on-start, join, the first iteration before any snapshot, a step later
on), some with the node's memory wiped (``node`` mode, or a node lost from outside),
and a kill from outside at a random wall-clock moment. The verdict is the checkpoint
oracle's (tests/harness/oracle.py): every run ends bit-identical to the failure-free run
(state hash, every loss, the final checkpoints item by item), and no collective waited
out its timeout. ``REFT_CHAOS_SEED`` / ``REFT_CHAOS_RUNS`` choose the campaign; a failed
run's plan is in its assertion message (rerun it with the same seed)."""

from __future__ import annotations

import os
import random
import re
import time

import pytest

from tests.integration.test_inprocess_startup import (ITERS, REF, assert_recovered_exactly,
                                                      finish, launch)

SEED = int(os.environ.get("REFT_CHAOS_SEED", "49"))
RUNS = int(os.environ.get("REFT_CHAOS_RUNS", "3"))
START_PHASES = ("data", "on-start", "join")


def plan(rng: random.Random) -> dict:
    """One run's faults: the first (attempt 0), one in the next generation's start-up
    (attempt 1), and maybe one from outside (after iteration ``after`` is logged)."""
    rank = rng.randrange(2)
    if rng.random() < 0.5:  # a start-up moment of the first generation
        phase, it, mode = rng.choice(START_PHASES), 0, ""
        restored = 0
    else:  # a step: iteration 1 (nothing committed yet) or later, maybe a lost node
        phase, it = "step", rng.randrange(1, ITERS)
        mode = rng.choice(("", "node")) if it > 1 else ""
        restored = it - 1  # the snapshot of it - 1 is committed before step it
    first = f"{rank}:{it}:KILL:{mode}:0@{phase}"
    second = f"{rng.randrange(2)}:{restored}:KILL::1@{rng.choice(START_PHASES)}"
    outside = None
    if rng.random() < 0.6:
        outside = dict(after=rng.randrange(1, ITERS), rank=rng.randrange(2),
                       delay=round(rng.uniform(0, 1.0), 2), wipe=rng.random() < 0.5)
    return dict(faults=f"{first},{second}", outside=outside)


PLANS = [plan(random.Random(SEED * 1000 + i)) for i in range(RUNS)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("p", PLANS, ids=[f"seed{SEED}-run{i}" for i in range(RUNS)])
def test_in_process_chaos(p, tmp_path, reference_runs):
    ref = reference_runs("dp2", 2, REF)
    with launch(tmp_path, p["faults"], spares=2, max_restarts=8) as L:
        o = p["outside"]
        if o is not None:
            try:
                L.wait_for(rf"iteration\s+{o['after']}/", timeout=400)
                time.sleep(o["delay"])
                if o["wipe"]:
                    L.kill_node(o["rank"])  # the node lost: its memory too
                else:
                    L.sup.kill_rank(o["rank"])
            except TimeoutError:
                pass  # the job ended first (or went on past it): nothing to kill
        run = finish(L, timeout=800)
    first = p["faults"].split(",")[0]
    r, it = first.split(":")[:2]
    assert re.search(rf"\[FAULT\] injecting SIGKILL into rank {r} .* iteration {it}, ",
                     run.output), (p, run.output[-4000:])
    try:
        assert_recovered_exactly(run, ref)
    except AssertionError as exc:
        raise AssertionError(f"plan {p} (history {run.history}): {exc}") from None
