"""A short seeded chaos campaign (tools/chaos.py, docs/chaos.md) in the default tier: two
job runs of PP2 x DP2 with ARC, three faults each, every fault on its own torchrun
attempt, each at another moment; every run must end bit-identical to the failure-free
run (shared with the other PP2 x DP2 tests of six iterations).

Seed 977 draws (python tools/chaos.py --dry-run with the flags below):
  run 0: attempt 0 node loss of rank 1 @forward 1 (nothing committed: a fresh start); attempt 1 SIGKILL of rank 2 halfway
         through writing the snapshot of iteration 2 (@snapshot-write: the torn slot is
         never loaded, the job goes back to iteration 1); attempt 2 SIGKILL of rank 3
         from outside, at a random moment after iteration 3, and node 1's watcher killed
         halfway through the flush that follows (its cut-short flush is never imported);
  run 1: attempt 0 rank 0's node lost from outside (SIGKILL, /dev/shm directory and
         watcher removed) after iteration 1; attempt 1 a flipped byte in rank 1's last
         committed snapshot (iteration 2) then SIGKILL @send 4 (the checksum catches it,
         the ARC replica serves); attempt 2 SIGTERM of rank 1 during the start-up health
         check (the recovery of attempt 3 does the same).
This covers, among others, what test_reft_recovery.py's kill-during-snapshot and
flipped-byte tests checked (both now in the slow tier)."""

import json

import pytest

from tests.harness.recovery import N
from tests.harness.run import LAYOUTS, TINY, RunResult
from tools import chaos

SEED = 977
# no persistent save before the end (--save-interval 100): a checkpoint newer than host
# memory would serve the recoveries this test wants from host memory
FLAGS = ["--seed", str(SEED), "--faults", "6", "--faults-per-run", "3", "--iters", "6",
         "--save-interval", "100", "--layouts", "pp2dp2:arc", "--flush-share", "0.3",
         "--kinds", "kill", "term", "node", "corrupt", "corrupt-manifest", "ext-kill",
         "ext-node"]


@pytest.mark.slow  # ~2.5 min on 2 cores: make test-all and make chaos run campaigns
def test_seeded_campaign_recovers_every_fault_bit_exact(tmp_path, reference_runs):
    opts = chaos.options(FLAGS + ["--work-dir", str(tmp_path), "--out",
                                  str(tmp_path / "chaos.json")])
    assert opts.run_iters == int(N[1])  # the shared reference's length
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    ref_losses = {it: v for _, it, v in
                  chaos.iteration_losses((0.0, line) for line in ref.output.splitlines())}
    results, code = chaos.run_campaign(opts, {("pp2dp2", opts.run_iters): (ref, ref_losses)})
    faults = results["faults"]
    s = results["summary"]
    logs = [r["log"] for r in results["runs"]]
    assert code == 0, (json.dumps(s, indent=1), [f for f in faults if f["verdict"] != "exact"],
                       logs)
    assert s["fired"] == s["faults"] == s["exact"] == 7, s  # 6 + a watcher mid-flush
    assert s["runs_exact"] == 2 and s["torn_loads"] == 0, s
    # and the independent witness: each run's final checkpoint, item by item
    assert [r["checkpoint"] for r in results["runs"]] == ["identical"] * 2, results["runs"]
    assert s["false_hang_verdicts"] == s["false_health_verdicts"] == 0, s
    by = {(f["kind"], f["phase"]): f for f in faults}
    # the torn snapshot of iteration 2 is never loaded: back to iteration 1, own memory
    torn = by[("kill", "snapshot-write")]
    assert (torn["iteration"], torn["restored"], torn["tier"]) == (2, 1, "own"), torn
    # the flipped byte: rank 1's own slice fails its checksum, the ARC replica serves
    flipped = by[("corrupt", "send")]
    assert flipped["tier"].split()[0] == "ARC" and flipped["restored"] == 2, flipped
    # a node lost in iteration 1 or 2: nothing or iteration 1 committed (a fresh start,
    # or the lost slice from its ARC replica, by when the wall-clock fault landed)
    assert by[("node", "forward")]["tier"] == "fresh start", by[("node", "forward")]
    assert by[("ext-node", "wall-clock")]["tier"] in ("fresh start", "ARC"), \
        by[("ext-node", "wall-clock")]
    assert by[("watcher-kill", "flush")]["fired"], by[("watcher-kill", "flush")]
    assert set(f["origin"] for f in faults) == {"internal", "external", "watcher"}


def test_plans_fire_in_order_and_parse(tmp_path):
    """No job runs: over many seeds and every layout, each fault's specs parse as
    --inject-fault reads them, each attempt's fault lies past every iteration an earlier
    attempt may have restored, hangs are frozen only where the hang monitor judges, and a
    run's terminal fault (no restart follows) comes last."""
    from reft_ext.testing.fault_specs import parse_fault_specs

    for seed in range(40):
        opts = chaos.options(["--seed", str(seed), "--faults", "25", "--faults-per-run", "5",
                              "--work-dir", str(tmp_path)])
        for p in chaos.plan_campaign(opts):
            specs = parse_fault_specs(p.inject(), 4)
            assert len(specs) == sum(len(f.specs()) for f in p.faults)
            reach, last = 0, [f for f in p.faults if f.stops][-1]
            for f in p.faults:
                if not f.stops:  # a watcher's (beside a kill), a straggler (slow)
                    continue
                if f.phase in chaos.RESTART_PHASES:
                    assert f.candidates and f.candidates[-1] == reach, f
                    assert f.attempt > 0 or f.phase == "health", f
                else:
                    assert f.iteration > reach and f.iteration < p.train_iters, (f, reach)
                    if f.kind in ("stop", "ext-stop"):
                        assert f.iteration >= reach + 2, f
                    reach = f.iteration + (2 if f.origin == "external" else 0)
                if f.kind == "stop":
                    assert f.phase in chaos.ARMED_PHASES, f
                if f.kind == "shm-full":
                    assert (f.phase, f.attempt) == ("health", 0), f
                if f.phase in chaos.TERMINAL_PHASES:
                    assert f is last, p.faults
                if f.phase in chaos.SAVE_PHASES:
                    assert f.iteration % opts.save_interval == 0, f
            assert [f.attempt for f in p.faults if f.stops] == \
                list(range(p.restarts())), p.faults


def _plan_of(flags):
    return [(f.run, f.layout, f.attempt, f.kind, f.phase, f.rank, f.iteration,
             f.candidates, f.delay) for p in chaos.plan_campaign(chaos.options(flags))
            for f in p.faults if f.kind != "slow"]


def test_stragglers_leave_a_seeds_other_faults_as_they_were(tmp_path):
    """No job runs: kind slow (a straggler) draws from its own generator, so a seed's
    other faults are the same with it (--slow-share 1) as without it (--kinds less slow);
    its spec is one --inject-fault reads, and it costs no restart."""
    from reft_ext.testing.fault_specs import SLOW, parse_fault_spec

    plain = [k for k in chaos.KINDS if k not in chaos.STRAGGLER_KINDS]
    assert "slow" in chaos.options([]).kinds  # in the default draw
    for seed in range(12):
        base = ["--seed", str(seed), "--faults", "12", "--faults-per-run", "4",
                "--work-dir", str(tmp_path)]
        assert _plan_of(base + ["--slow-share", "1"]) == _plan_of(base + ["--kinds", *plain])
        without = chaos.plan_campaign(chaos.options(base + ["--kinds", *plain,
                                                            "--slow-share", "1"]))
        assert not [f for p in without for f in p.faults if f.kind == "slow"]
        for p in chaos.plan_campaign(chaos.options(base + ["--slow-share", "1"])):
            slow = [f for f in p.faults if f.kind == "slow"]
            assert len(slow) == 1, p.faults  # one per job run at share 1
            f = slow[0]
            assert (f.origin, f.phase, f.attempt, f.stops) == ("straggler", "slow", 0, False)
            assert 0 <= f.rank < 4 and 1 <= f.iteration <= p.train_iters - 4, f
            spec = parse_fault_spec(f.specs()[0], 4)
            assert (spec.rank, spec.iteration, spec.mode, spec.factor) == \
                (f.rank, f.iteration, SLOW, 2.0), spec
            assert p.restarts() == sum(1 for g in p.faults if g.origin in
                                       ("internal", "external"))
            assert f"to rank {f.rank} from iteration {f.iteration}" in f.describe()


def _job(straggler_named: bool):
    """A synthetic job run: rank 2 SIGKILLed in iteration 3 (own memory restores 2), rank
    1 slowed from iteration 2 on both attempts; the logged losses are the reference's."""
    it = " iteration {:8d}/       6 | consumed samples: 8 | lm loss: 1.0E+01 |".format
    lines = [(1.0, it(1)),
             (2.0, "[FAULT] slowing rank 1 (pid 101) 2x from iteration 2: a sleep of 1x "
                   "its forward-backward compute before each gradient sync"),
             (3.0, it(2)),
             (4.0, "[FAULT] injecting SIGKILL into rank 2 (pid 102) at iteration 3, "
                   "phase forward"),
             (6.0, "[FAULT] slowing rank 1 (pid 201) 2x from iteration 3: ..."),
             *[(6.0 + i, it(i)) for i in range(3, 7)]]
    events = [{"event": "recovery", "rank": 0, "time": 5.0, "source": "own memory",
               "iteration": 2, "ms": 12.0}]
    if straggler_named:
        events.append({"event": "straggler", "rank": 1, "time": 11.0, "iteration": 5,
                       "ratio": 2.04})
    hashes, losses = {r: f"h{r}" for r in range(4)}, {6: "0x1.4p+3"}
    res, ref = (RunResult(0, "", dict(hashes), dict(losses), {3: dict(losses)})
                for _ in range(2))
    return (chaos.JobOutput(0, lines, events, res, 12.0, restarts=1), ref,
            {i: "1.0E+01" for i in range(1, 7)})


def test_a_straggler_is_judged_fired_and_named_without_a_recovery(tmp_path):
    """No job runs: analyze() on a synthetic run's lines and events. The straggler fires
    at its rank's first [FAULT] slowing line, is named by the first straggler event of
    its rank (or not: no problem), needs no recovery or restart, and is exact when the
    run is."""
    from tools.chaos_report import fault_line, summary

    opts = chaos.options(["--work-dir", str(tmp_path)])
    for named in (True, False):
        kill = chaos.Fault(0, 0, "dp4:aec", 0, "kill", "forward", 2, 3)
        slow = chaos.Fault(1, 0, "dp4:aec", 0, "slow", "slow", 1, 2)
        plan = chaos.RunPlan(0, "dp4", "aec", 6, [kill, slow])
        job, ref, ref_losses = _job(named)
        rec = chaos.analyze(plan, job, ref, ref_losses, opts)
        assert rec["exact"] and not rec["problems"], rec
        assert (kill.fired, kill.tier, kill.restored, kill.verdict) == \
            (True, "own", 2, "exact"), kill
        assert (slow.fired, slow.t_fired, slow.pid, slow.verdict) == \
            (True, 2.0, 101, "exact"), slow
        assert slow.where.startswith("[FAULT] slowing rank 1 (pid 101)"), slow.where
        assert slow.restored is None and slow.downtime_s is None, slow
        s = summary([rec], plan.faults, opts)
        assert s["by_tier"] == {"own": 1} and s["exact"] == 2, s
        if named:
            assert slow.tier == "named at iteration 5", slow
            assert "-> named a straggler at iteration 5" in fault_line(slow)
            assert s["stragglers_named"] == 1, s
        else:
            assert slow.tier == "not named", slow
            assert "-> not named" in fault_line(slow)
            assert s["stragglers_named"] == 0, s
