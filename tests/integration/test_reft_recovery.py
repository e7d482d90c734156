"""REFT-save / REFT-load end to end: real torchrun, SIGKILLed ranks, real /dev/shm.

Every recovered run must end bit-identical (state hash per rank, every later loss) to
the same run without the failure, and the fault must really have fired."""

import os
import re
import subprocess
import sys

import pytest

from tests.harness import events as ev
from tests.harness.compare import same_as_reference
from tests.harness.recovery import (N, OWN, PARITY, REPLICA, assert_persistent_fallback,
                                    assert_recovered, reft)
from tests.harness.run import LAYOUTS, REPO, TINY, events_file, parse, torchrun


# The fault fires after ITER's passes and after before_optimizer_step, which under has and
# host-thread drains and commits the snapshot of ITER-1 (under end-of-iteration it was
# committed right after step ITER-1): every schedule must go back to exactly ITER-1.
RECOVERED = {"has": (2, 4), "host-thread": (2, 4), "end-of-iteration": (2, 4)}


def _assert_schedule_ran(run, schedule):
    """Rank 0's snapshot events name the schedule that copied them (has/host-thread report
    their tiers; end-of-iteration copies inline and reports none)."""
    snaps = run.events_of("snapshot")
    assert snaps, run.output[-3000:]
    threaded = [e for e in snaps if e["tiers"] is not None]
    if schedule == "end-of-iteration":
        assert not threaded and all(e["schedule"] is None for e in snaps), snaps
    else:
        assert len(threaded) == len(snaps), snaps
        assert all(e["schedule"] == schedule for e in snaps), snaps


# all in `make test-all`: the default tier has the same crash + lost node under has in
# the demo test below (PP2xDP2 ZeRO-1, arc,aor: a superset) and aec in the DP4 decode test
@pytest.mark.parametrize("layout,protect,schedule", [
    pytest.param("pp2dp2", "arc", "has", marks=pytest.mark.slow),
    pytest.param("pp2dp2", "arc", "end-of-iteration", marks=pytest.mark.slow),
    pytest.param("pp2dp2", "arc", "host-thread", marks=pytest.mark.slow),
    pytest.param("tp2dp2", "aec", "has", marks=pytest.mark.slow),
    pytest.param("pp2dp2", "none", "has", marks=pytest.mark.slow),
    pytest.param("tp2dp2", "none", "has", marks=pytest.mark.slow),
    pytest.param("tp2dp2", "arc", "has", marks=pytest.mark.slow),
    pytest.param("pp2dp2", "aec", "has", marks=pytest.mark.slow)])
def test_crash_then_node_loss(layout, protect, schedule, tmp_path, reference_runs):
    """Attempt 0: rank 1 crashes at iteration 3 -> every rank reloads iteration 2 from its
    own memory. Attempt 1: rank 2's node is lost at iteration 5 -> arc/aec rebuild its
    slice from peers; none falls back to the persistent checkpoint of iteration 4."""
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS[layout] + reft(protect) + [
        "--reft-schedule", schedule, "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "1:3,2:5:KILL:node:1"], max_restarts=2).check()
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert "[FAULT] wiped failure domain 2" in run.output
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    _assert_schedule_ran(run, schedule)
    crash, lost = RECOVERED[schedule]
    assert_recovered(run.events, crash, {r: OWN for r in range(4)})
    if protect == "none":
        assert_persistent_fallback(run.events, lost, save,
                                   reason=f"iteration {lost}: sharding group ")
        assert any("lost the slices of ranks [2]" in e["reason"]
                   for e in run.events_of("recovery_impossible"))
    else:
        source = {"arc": REPLICA, "aec": PARITY}[protect]
        assert_recovered(run.events, lost, {2: source, 0: OWN, 1: OWN, 3: OWN})
    same_as_reference(run, ref, lost + 1)


@pytest.mark.slow  # make test's 12 minutes; the default tier: test_zeropp.py's crash then
# lost node (ZeRO-1, arc,aor) and test_summary_and_demo.py's demo digest
def test_demo_crash_then_lost_node_with_zero1_arc_aor(tmp_path, reference_runs):
    """`make demo` (tools/demo.py) on the tiny model, the default job's layout and flags:
    a crash (every rank reloads its own memory, ZeRO-1 shards included), then a lost node
    (its slice from an ARC replica, its optimizer shard from an AOR replica). The digest,
    the summary and the state all match the failure-free run bit for bit."""
    layout = "pp2dp2-zero1"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    ref_log = tmp_path / "reference.log"
    ref_log.write_text(ref.output)
    events = events_file(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    demo = subprocess.run(
        [sys.executable, "tools/demo.py", "--run-dir", str(tmp_path / "demo"),
         "--nproc", "4", "--compare", str(ref_log), "--compare-checkpoint", ref.checkpoint,
         "--", *TINY, *N, *LAYOUTS[layout],
         *reft("arc,aor"), "--inject-fault", "1:3,2:5:KILL:node:1"],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**env, ev.ENV: events})
    out = demo.stdout
    assert demo.returncode == 0, out[-4000:] + demo.stderr[-2000:]
    run = parse((tmp_path / "demo" / "train.log").read_text(), demo.returncode, events)
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert "[FAULT] wiped failure domain 2" in run.output
    assert_recovered(run.events, 2, {r: OWN for r in range(4)})
    # the job-wide record of each recovery: what served it (the digest below says it too)
    assert [(e["iteration"], e["source"]) for e in run.events_of("recovery")] == \
        [(2, "own memory"), (4, "ARC replica + AOR replica")]
    assert_recovered(run.events, 4, {2: REPLICA}, aor_from={2: 3})
    assert "- crash: SIGKILL to rank 1 in iteration 3" in out
    assert "REFT-load: iteration 2 from own memory in" in out
    assert "- lost node: SIGKILL to rank 2 in iteration 5" in out
    assert "REFT-load: iteration 4 from ARC replica + AOR replica in" in out
    assert out.count("training again") == 2
    assert ("[REFT] summary: 6 snapshots (every 1 iteration, --reft-protect arc,aor)"
            in run.output)
    assert "recoveries: 1 from own memory, 1 from ARC replica + AOR replica;" in run.output
    assert "bit-identical to the failure-free run" in out
    assert "- final checkpoint identical to the failure-free run's, item by item" in out
    run.checkpoint = str(tmp_path / "demo" / "checkpoints")
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # make test's 12 minutes (it pays a DP4 reference run of its own);
# AEC parity in the default tier: tests/integration/test_has.py
def test_lost_node_dp4_aec_decodes_from_three_parities(reference_runs):
    ref = reference_runs("dp4", 4, TINY + N + LAYOUTS["dp4"])
    run = torchrun(4, TINY + N + LAYOUTS["dp4"] + reft("aec") +
                   ["--inject-fault", "2:5:KILL:node"], max_restarts=1).check()
    assert "[FAULT] wiped failure domain 2" in run.output
    assert_recovered(run.events, 4, {2: PARITY})
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # make test's 12 minutes; the default tier falls back to the persistent
# checkpoint in test_bytes_flipped_in_transit_... below, and plans beyond protection in
# tests/unit/test_recovery_plan.py and test_placement.py
def test_two_lost_members_fall_back_to_persistent(tmp_path, reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") + [
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "0:5:KILL:node,1:5:KILL:node"], max_restarts=1).check()
    assert run.output.count("[FAULT] wiped failure domain") == 2
    assert_persistent_fallback(run.events, 4, save, reason=(
        "iteration 4: sharding group [0, 1] lost the slices of ranks [0, 1], more than "
        "--reft-protect arc can rebuild"))
    same_as_reference(run, ref, 5)


# slow tier (make test's budget): tests/unit/test_received.py checks the receiver's
# verification in the default tier; this is the end-to-end run
@pytest.mark.slow
def test_bytes_flipped_in_transit_are_caught_by_the_receiver(tmp_path, reference_runs):
    """Rank 2's node is lost; on the restart, rank 3 (its ARC and AOR holder) sends it
    both slices of their group and its optimizer shard with a byte flipped in each copy sent (its
    snapshot intact). Rank 2 checks each against the checksum its writer recorded, every
    rank agrees before anything is written, and the job falls back to the persistent
    checkpoint: bit-identical to the failure-free run."""
    layout = "pp2dp2-zero1"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS[layout] + reft("arc,aor") + [
        "--save", save, "--load", save, "--save-interval", "3",
        "--inject-fault", "2:5:KILL:node,3:4:CONT:corrupt-send:1@load-read"],
        max_restarts=1).check()
    assert "[FAULT] wiped failure domain 2" in run.output
    for what in ("slice 0 (rank 2's)", "slice 1 (rank 3's)", "AOR replica"):
        assert (f"[FAULT] flipped a byte of {what} rank 3 sends to rank 2 while restoring "
                f"iteration 4") in run.output, what
    problems = [(e["rank"], e["problem"].split(" received")[0])
                for e in run.events_of("received_corrupt", iteration=4)]
    assert sorted(problems) == [(2, "slice 0 (rank 2's)"), (2, "slice 1 (rank 3's)"),
                                (2, "the AOR replica of its optimizer shard")], problems
    assert_persistent_fallback(run.events, 3, save,
                               reason="received data failed its checksum")
    assert not run.events_of("recovered"), "nothing restored from host memory"
    same_as_reference(run, ref, 4)


@pytest.mark.slow  # make test's 12 minutes; the receiver's checks in the default tier:
# test_bytes_flipped_in_transit_are_caught_by_the_receiver above
def test_parity_block_flipped_in_transit_is_caught(tmp_path, reference_runs):
    """AEC: rank 0's slice and parity block reach the others with a byte flipped."""
    ref = reference_runs("dp4", 4, TINY + N + LAYOUTS["dp4"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["dp4"] + reft("aec") + [
        "--save", save, "--load", save, "--save-interval", "3",
        "--inject-fault", "2:5:KILL:node,0:4:CONT:corrupt-send:1@load-read"],
        max_restarts=1).check()
    assert "[FAULT] flipped a byte of parity block rank 0 sends to its group" in run.output
    problems = {(e["rank"], e["problem"].split(" received")[0])
                for e in run.events_of("received_corrupt", iteration=4)}
    assert {(r, "the aec parity block") for r in (1, 2, 3)} <= problems, problems
    assert {(r, "slice 0 (rank 0's)") for r in (1, 2, 3)} <= problems, problems
    assert_persistent_fallback(run.events, 3, save,
                               reason="received data failed its checksum")
    same_as_reference(run, ref, 4)


@pytest.mark.slow  # tests/integration/test_chaos.py covers it in the default tier
def test_kill_during_snapshot_never_loads_torn_state(reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("aec") +
                   ["--inject-fault", "2:5:KILL:snapshot"], max_restarts=1).check()
    # the kill landed inside the snapshot of iteration 5 (own slice written, no manifest)
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    assert "during its snapshot write" in run.output
    # rank 2's torn slot is never read, and iteration 5 was never committed (the commit
    # needs every rank): whatever the others had finished, the job goes back to 4
    assert_recovered(run.events, 4, {r: OWN for r in range(4)})
    same_as_reference(run, ref, 5)


@pytest.mark.slow  # tests/integration/test_chaos.py covers it in the default tier
def test_flipped_byte_is_caught_and_replica_used(reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") +
                   ["--inject-fault", "1:5:KILL:corrupt"], max_restarts=1).check()
    assert "[FAULT] flipped a byte of rank 1's snapshot of iteration 4" in run.output
    assert_recovered(run.events, 4, {1: REPLICA})
    # the failed checksum named with its file and what served the slice instead
    assert re.search(r"^\[REFT\] rank 1: \S+/rank1\.slot\d\.bin failed its \S+ checksum in "
                     r"its slice of the parameters and replicated optimizer state \(own "
                     r"region, iteration 4\): rebuilt from the ARC replica on rank \d$",
                     run.output, re.M), \
        [x for x in run.output.splitlines() if "failed its" in x]
    assert [e["rank"] for e in run.events_of("checksum_repaired", iteration=4)] == [1]
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_flipped_byte_loaded_while_verified_is_overwritten(tmp_path, reference_runs):
    """With a persistent checkpoint (so a failed REFT-load is followed by a full load),
    round 1 verifies each rank's own slot while writing it into the model
    (reft_ext/load/fused.py): rank 1's flipped slice lands in its model before its
    checksum fails, and the ARC replica must overwrite it, bit for bit."""
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") + [
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "1:5:KILL:corrupt"], max_restarts=1).check()
    assert "[FAULT] flipped a byte of rank 1's snapshot of iteration 4" in run.output
    assert_recovered(run.events, 4, {1: REPLICA})
    for r in (0, 2, 3):  # their own slots were restored in the verifying pass
        e = run.events_of("recovered", iteration=4, rank=r, source=OWN)[0]
        assert e["verify_load"], e
    same_as_reference(run, ref, 5)


# ---- the layouts and dtypes the tests above do not cover (make test-all) ---------------
@pytest.mark.slow
def test_lost_node_tp2pp2dp2_arc(reference_runs):
    """TP2 x PP2 x DP2 on 8 ranks: sharding groups [0, 2] [1, 3] [4, 6] [5, 7], each member
    a distinct tensor-and-pipeline shard. Rank 5's node is lost: its slice comes from the
    ARC replica rank 7 holds; the other seven reload their own memory."""
    args = TINY + N + LAYOUTS["tp2pp2"]
    ref = reference_runs("tp2pp2dp2", 8, args)
    run = torchrun(8, args + reft("arc") + ["--inject-fault", "5:5:KILL:node"],
                   max_restarts=1).check()
    assert "[FAULT] wiped failure domain 5" in run.output
    assert "[FAULT] injecting SIGKILL into rank 5 (pid" in run.output
    five = run.events.one("recovered", iteration=4, rank=5, source=REPLICA)
    assert (five["group"], five["rebuilt"], five["aor_from"]) == ([5, 7], 1, None), five
    assert_recovered(run.events, 4, {r: OWN for r in (0, 1, 2, 3, 4, 6, 7)})
    assert sorted(run.hashes) == list(range(8))
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_lost_node_interleaved_pp2_arc(reference_runs):
    """Interleaved 1F1B (two model chunks per stage): the snapshot and the rebuilt slice
    cover both chunks of the lost rank."""
    layout = "pp2-interleaved"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    run = torchrun(4, TINY + N + LAYOUTS[layout] + reft("arc") +
                   ["--inject-fault", "2:5:KILL:node"], max_restarts=1).check()
    assert "[FAULT] wiped failure domain 2" in run.output
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    assert_recovered(run.events, 4, {2: REPLICA, 0: OWN, 1: OWN, 3: OWN})
    same_as_reference(run, ref, 5)


@pytest.mark.slow
def test_lost_node_bf16_zero1_arc_aor(reference_runs):
    """bf16 with ZeRO-1: bf16 model params (replicated, ARC), fp32 main params and Adam
    moments (owned shards, AOR). Rank 2's node is lost: its slice comes from rank 3's ARC
    replica, its fp32 shard from rank 3's AOR replica."""
    args = TINY + N + LAYOUTS["pp2dp2-zero1"] + ["--bf16"]
    ref = reference_runs("pp2dp2-zero1 bf16", 4, args)
    run = torchrun(4, args + reft("arc,aor") +
                   ["--inject-fault", "2:5:KILL:node"], max_restarts=1).check()
    assert "[FAULT] wiped failure domain 2" in run.output
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    assert_recovered(run.events, 4, {2: REPLICA, 0: OWN, 1: OWN, 3: OWN}, aor_from={2: 3})
    same_as_reference(run, ref, 5)
