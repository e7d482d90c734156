"""REFT-save / REFT-load end to end: real torchrun, SIGKILLed ranks, real /dev/shm.

Every recovered run must end bit-identical (state hash per rank, every later loss) to
the same run without the failure, and the fault must really have fired."""

import os
import subprocess
import sys

import pytest

from tests.harness.run import LAYOUTS as SHARED_LAYOUTS
from tests.harness.run import REPO, TINY, parse, torchrun

LAYOUTS = {  # non-distributed optimizer: the whole state is replicated across DP
    "pp2dp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
    "tp2dp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"],
    "dp4": ["--global-batch-size", "8"],
    # ZeRO-1: optimizer shards are owned state, saved whole by their owner
    "pp2dp2-zero1": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                     "--global-batch-size", "8"],
    # the same flags as conftest's (its failure-free runs are shared by command line)
    "tp2pp2": SHARED_LAYOUTS["tp2pp2"],  # TP2 x PP2 x DP(ranks / 4)
    "pp2-interleaved": SHARED_LAYOUTS["pp2-interleaved"],  # PP2 x DP2, 2 chunks per stage
}
N = ["--train-iters", "6"]


def reft(protect):
    return ["--reft-snapshot-every", "1", "--reft-protect", protect,
            "--reft-ranks-per-node", "1"]


def _same_as_reference(run, ref, first_after):
    assert run.hashes == ref.hashes
    assert sorted(run.losses)[0] == first_after and max(run.losses) == 6
    assert all(run.losses[i] == ref.losses[i] for i in run.losses)


# The fault fires after ITER's passes and after before_optimizer_step, which under has and
# host-thread drains and commits the snapshot of ITER-1 (under end-of-iteration it was
# committed right after step ITER-1): every schedule must go back to exactly ITER-1.
RECOVERED = {"has": (2, 4), "host-thread": (2, 4), "end-of-iteration": (2, 4)}


def _assert_schedule_ran(output, schedule):
    """Rank 0's snapshot lines name the schedule that copied them (has/host-thread report
    their tiers; end-of-iteration copies inline and reports none)."""
    lines = [ln for ln in output.splitlines() if "[REFT] snapshot iteration" in ln]
    assert lines, output[-3000:]
    threaded = [ln for ln in lines if " B in bubbles" in ln]
    if schedule == "end-of-iteration":
        assert not threaded, threaded[0]
    else:
        assert len(threaded) == len(lines), lines
        assert all(f", {schedule}: " in ln for ln in lines), lines


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
    _assert_schedule_ran(run.output, schedule)
    crash, lost = RECOVERED[schedule]
    for r in range(4):
        assert f"[REFT] recovered iteration {crash} on rank {r} from own memory" in run.output
    if protect == "none":
        assert f"[REFT] recovery from host memory not possible: iteration {lost}: sharding " \
               f"group " in run.output and "lost the slices of ranks [2]" in run.output
        assert f"[REFT] recovered iteration {lost} from the persistent checkpoint {save}" \
            in run.output
    else:
        source = {"arc": "ARC replica", "aec": "AEC parity"}[protect]
        assert f"[REFT] recovered iteration {lost} on rank 2 from {source}" in run.output
        for r in (0, 1, 3):
            assert f"[REFT] recovered iteration {lost} on rank {r} from own memory" \
                in run.output
    _same_as_reference(run, ref, lost + 1)


def test_demo_crash_then_lost_node_with_zero1_arc_aor(tmp_path, reference_runs):
    """`make demo` (tools/demo.py) on the tiny model, the default job's layout and flags:
    a crash (every rank reloads its own memory, ZeRO-1 shards included), then a lost node
    (its slice from an ARC replica, its optimizer shard from an AOR replica). The digest,
    the summary and the state all match the failure-free run bit for bit."""
    layout = "pp2dp2-zero1"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    ref_log = tmp_path / "reference.log"
    ref_log.write_text(ref.output)
    demo = subprocess.run(
        [sys.executable, "tools/demo.py", "--run-dir", str(tmp_path / "demo"),
         "--nproc", "4", "--compare", str(ref_log), "--", *TINY, *N, *LAYOUTS[layout],
         *reft("arc,aor"), "--inject-fault", "1:3,2:5:KILL:node:1"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
        env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"})
    out = demo.stdout
    assert demo.returncode == 0, out[-4000:] + demo.stderr[-2000:]
    run = parse((tmp_path / "demo" / "train.log").read_text(), demo.returncode)
    assert "[FAULT] injecting SIGKILL into rank 1 (pid" in run.output
    assert "[FAULT] wiped failure domain 2" in run.output
    for r in range(4):
        assert f"[REFT] recovered iteration 2 on rank {r} from own memory" in run.output
    assert "- crash: SIGKILL to rank 1 in iteration 3" in out
    assert "REFT-load: iteration 2 from own memory in" in out
    assert "- lost node: SIGKILL to rank 2 in iteration 5" in out
    assert "REFT-load: iteration 4 from ARC replica + AOR replica in" in out
    assert out.count("training again") == 2
    assert ("[REFT] summary: 6 snapshots (every 1 iteration, --reft-protect arc,aor)"
            in run.output)
    assert "recoveries: 1 from own memory, 1 from ARC replica + AOR replica;" in run.output
    assert "bit-identical to the failure-free run" in out
    _same_as_reference(run, ref, 5)


def test_lost_node_dp4_aec_decodes_from_three_parities(reference_runs):
    ref = reference_runs("dp4", 4, TINY + N + LAYOUTS["dp4"])
    run = torchrun(4, TINY + N + LAYOUTS["dp4"] + reft("aec") +
                   ["--inject-fault", "2:5:KILL:node"], max_restarts=1).check()
    assert "[FAULT] wiped failure domain 2" in run.output
    assert "[REFT] recovered iteration 4 on rank 2 from AEC parity" in run.output
    _same_as_reference(run, ref, 5)


def test_two_lost_members_fall_back_to_persistent(tmp_path, reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") + [
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "0:5:KILL:node,1:5:KILL:node"], max_restarts=1).check()
    assert run.output.count("[FAULT] wiped failure domain") == 2
    assert "[REFT] recovery from host memory not possible: iteration 4: sharding group " \
           "[0, 1] lost the slices of ranks [0, 1], more than --reft-protect arc can " \
           "rebuild" in run.output
    assert f"[REFT] recovered iteration 4 from the persistent checkpoint {save}" in run.output
    _same_as_reference(run, ref, 5)


def test_kill_during_snapshot_never_loads_torn_state(reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("aec") +
                   ["--inject-fault", "2:5:KILL:snapshot"], max_restarts=1).check()
    # the kill landed inside the snapshot of iteration 5 (own slice written, no manifest)
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    assert "during its snapshot write" in run.output
    # rank 2's torn slot is never read, and iteration 5 was never committed (the commit
    # needs every rank): whatever the others had finished, the job goes back to 4
    for r in range(4):
        assert f"[REFT] recovered iteration 4 on rank {r} from own memory" in run.output
    _same_as_reference(run, ref, 5)


def test_flipped_byte_is_caught_and_replica_used(reference_runs):
    ref = reference_runs("pp2dp2", 4, TINY + N + LAYOUTS["pp2dp2"])
    run = torchrun(4, TINY + N + LAYOUTS["pp2dp2"] + reft("arc") +
                   ["--inject-fault", "1:5:KILL:corrupt"], max_restarts=1).check()
    assert "[FAULT] flipped a byte of rank 1's snapshot of iteration 4" in run.output
    assert "[REFT] recovered iteration 4 on rank 1 from ARC replica" in run.output
    _same_as_reference(run, ref, 5)


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
    assert "[REFT] recovered iteration 4 on rank 1 from ARC replica" in run.output
    for r in (0, 2, 3):  # their own slots were restored in the verifying pass
        line = next(ln for ln in run.output.splitlines()
                    if f"[REFT] recovered iteration 4 on rank {r} from own memory" in ln)
        assert "verify+load+agree" in line, line
    _same_as_reference(run, ref, 5)


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
    assert ("[REFT] recovered iteration 4 on rank 5 from ARC replica (group [5, 7]: 1 "
            "slice(s) rebuilt)") in run.output
    for r in (0, 1, 2, 3, 4, 6, 7):
        assert f"[REFT] recovered iteration 4 on rank {r} from own memory" in run.output
    assert sorted(run.hashes) == list(range(8))
    _same_as_reference(run, ref, 5)


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
    assert "[REFT] recovered iteration 4 on rank 2 from ARC replica" in run.output
    for r in (0, 1, 3):
        assert f"[REFT] recovered iteration 4 on rank {r} from own memory" in run.output
    _same_as_reference(run, ref, 5)


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
    assert ("[REFT] recovered iteration 4 on rank 2 from ARC replica, optimizer shard from "
            "the AOR replica on rank 3") in run.output
    for r in (0, 1, 3):
        assert f"[REFT] recovered iteration 4 on rank {r} from own memory" in run.output
    _same_as_reference(run, ref, 5)
