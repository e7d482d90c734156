"""AOR end to end: with ZeRO-1 a lost node takes its optimizer shards with it; the AOR
replica its holder keeps in another failure domain brings them back. Two node losses per
run (on successive torchrun attempts, different ranks), the replicas verified against
their owners every iteration, and the run must end bit-identical (parameters, optimizer
state, every loss) to the run without failures."""

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import (N, PARITY, REPLICA, assert_persistent_fallback,
                                    assert_recovered)
from tests.harness.run import LAYOUTS, TINY, torchrun

# sharding groups: pp2dp2 [0, 1] [2, 3]; dp4 [0, 1, 2, 3]. Member d-1 holds member d's
# ARC replica and AOR replica.
HOLDER = {"pp2dp2-zero1": {2: 3, 1: 0}, "dp4-zero1": {2: 1, 1: 0}}


# the default tier restores AOR shards in test_reft_recovery.py's demo (crash, then a
# lost node under ZeRO-1 arc,aor) and in the chaos campaign of test_chaos.py
@pytest.mark.slow
@pytest.mark.parametrize("layout,protect", [
    ("pp2dp2-zero1", "arc,aor"),
    pytest.param("pp2dp2-zero1", "aec,aor", marks=pytest.mark.slow),
    pytest.param("dp4-zero1", "arc,aor", marks=pytest.mark.slow),
    pytest.param("dp4-zero1", "aec,aor", marks=pytest.mark.slow)])
def test_lost_nodes_restore_optimizer_shards_from_aor(layout, protect, reference_runs):
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    run = torchrun(4, TINY + N + LAYOUTS[layout] + [
        "--reft-snapshot-every", "1", "--reft-protect", protect, "--reft-ranks-per-node", "1",
        "--reft-aor-verify-every", "1",
        "--inject-fault", "2:3:KILL:node:0,1:5:KILL:node:1"], max_restarts=2).check()
    out = run.output
    for rank in (2, 1):
        assert f"[FAULT] injecting SIGKILL into rank {rank} (pid" in out
        assert f"[FAULT] wiped failure domain {rank}" in out
    slices = REPLICA if protect.startswith("arc") else PARITY
    for rank, it in ((2, 2), (1, 4)):
        assert_recovered(run.events, it, {rank: slices}, aor_from=HOLDER[layout])
    # the final attempt verified every replica after every step: no mismatch
    checks = run.events.one("aor_checks")
    assert (checks["verifications"], checks["ranks"], checks["mismatches"]) == (8, 4, 0), checks
    assert "MISMATCH" not in out
    same_as_reference(run, ref, first_after=5)


@pytest.mark.slow
def test_without_aor_a_lost_zero1_shard_falls_back(tmp_path, reference_runs):
    """The same node loss with arc alone: the optimizer shard is gone, the log says so,
    and the job resumes from the persistent checkpoint, bit-identical to the run without
    failures."""
    layout = "dp4-zero1"
    ref = reference_runs(layout, 4, TINY + N + LAYOUTS[layout])
    save = str(tmp_path / "ckpt")
    run = torchrun(4, TINY + N + LAYOUTS[layout] + [
        "--reft-snapshot-every", "1", "--reft-protect", "arc", "--reft-ranks-per-node", "1",
        "--save", save, "--load", save, "--save-interval", "2",
        "--inject-fault", "2:4:KILL:node"], max_restarts=1).check()
    assert "[FAULT] injecting SIGKILL into rank 2 (pid" in run.output
    assert "[FAULT] wiped failure domain 2" in run.output
    assert any("ranks [2] lost their ZeRO-1 optimizer shards (no host replica without "
               "--reft-protect aor)" in e["reason"]
               for e in run.events_of("recovery_impossible")), run.events.names()
    assert_persistent_fallback(run.events, 2, save)
    same_as_reference(run, ref, first_after=3)
