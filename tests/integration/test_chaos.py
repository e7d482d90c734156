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
from tests.harness.run import LAYOUTS, TINY
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
            reach, last = 0, p.faults[-1]
            for f in p.faults:
                if f.origin == "watcher":
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
                    assert f is last or last.origin == "watcher", p.faults
                if f.phase in chaos.SAVE_PHASES:
                    assert f.iteration % opts.save_interval == 0, f
            assert [f.attempt for f in p.faults if f.origin != "watcher"] == \
                list(range(p.restarts())), p.faults
