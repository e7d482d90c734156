"""Loss-spike rollback from host memory, end to end: real torchrun, a spike or a NaN
injected into one rank's gradients or a NaN that a bad batch brings, every rank rolls
back in process and skips batches, the spiking one always included.

Each run must end bit-identical (state hash per rank, every loss) to a run without the
fault that skipped the same global batches from the start (--skip-train-batches), and
the skipped samples are the ones logged."""

import math

import pytest

from tests.harness.compare import same_state
from tests.harness.recovery import reft
from tests.harness.run import LAYOUTS, TINY, torchrun

ITERS = ["--train-iters", "14"]


def _rollback(e: dict) -> tuple:
    """What a rollback event says, but the time it took."""
    return (e["spike"], e["iteration"], e["skip_batches"], e["samples"], e["count"],
            e["limit"], e["window"])


def _same(run, ref):
    assert run.hashes and sorted(run.losses) == list(range(1, 15))
    same_state(run, ref)


@pytest.mark.slow  # make test's 12 minutes; the default tier's rollback:
# test_nan_on_one_rank_tp2pp2_rolls_back
def test_spike_then_nan_with_zero1_roll_back_and_skip(tmp_path, reference_runs):
    """PP2xDP2, ZeRO-1, arc,aor: rank 1's gradients scaled by 1e4 at iteration 10 (a grad
    norm spike) -> back to 8, skip 2 batches; then NaN in rank 2's gradients at 12 ->
    back to 10, skip 2. A checkpoint saved at 9 is from inside the first spike: it is
    replaced by the rolled-back state before anything else happens."""
    layout = LAYOUTS["pp2dp2-zero1"]
    save = str(tmp_path / "ckpt")
    ref = reference_runs("pp2dp2-zero1-skip9x2-11x2", 4,  # shared with test_bad_batches
                         TINY + ITERS + layout + ["--skip-train-batches", "9:2,11:2"])
    assert "skipping 2 global batch(es) before iteration 9: samples 64-79" in ref.output
    assert "skipping 2 global batch(es) before iteration 11: samples 96-111" in ref.output
    run = torchrun(4, TINY + ITERS + layout + reft("arc,aor") + [
        "--reft-rollback-on", "spike", "--reft-skip-batches", "2",
        "--save", save, "--save-interval", "9",
        "--inject-spike", "1:10:scale,2:12:nan"]).check()
    out = run.output
    assert "[FAULT] spike: rank 1's gradients scaled by 10000 before the optimizer step of " \
           "iteration 10" in out
    assert "[FAULT] spike: rank 2's gradients made NaN before the optimizer step of " \
           "iteration 12" in out
    spike, nan = run.events_of("rollback")  # these two, no other
    assert spike["reason"].startswith("grad norm spike: ") and \
        _rollback(spike) == (10, 8, 2, [64, 79], 1, 3, 20), spike
    assert nan["reason"] == "non-finite grad norm (nan)" and \
        _rollback(nan)[:6] == (12, 10, 2, [96, 111], 2, 3), nan
    assert "removed persistent checkpoint(s) iter_0000009 of" in out
    assert out.index("removed persistent checkpoint(s) iter_0000009") > \
        out.index("saved checkpoint at iteration       8")
    assert "loss-spike rollbacks: 2" in out
    _same(run, ref)


@pytest.mark.parametrize("schedule", [
    pytest.param("has", marks=pytest.mark.slow),  # NaN rollback: test_bad_batches_...
    pytest.param("end-of-iteration", marks=pytest.mark.slow),
    pytest.param("host-thread", marks=pytest.mark.slow)])
def test_nan_on_one_rank_tp2pp2_rolls_back(schedule, reference_runs):
    """TP2xPP2 (no data parallelism: --reft-protect none, each rank's own snapshot): NaN
    in rank 3's gradients only; all four ranks agree, roll back to 8 and skip the batches
    of 9 and 10 (the spiking one included). Every snapshot schedule has committed the same
    ring by the time the NaN is seen."""
    args = TINY + ITERS + LAYOUTS["tp2pp2"]
    ref = reference_runs("tp2pp2-skip9x2", 4, args + ["--skip-train-batches", "9:2"])
    run = torchrun(4, args + reft("none") + ["--reft-schedule", schedule,
                                             "--inject-spike", "3:10:nan"]).check()
    assert "[FAULT] spike: rank 3's gradients made NaN before the optimizer step of " \
           "iteration 10" in run.output
    nan = run.events.one("rollback")
    assert nan["reason"] == "non-finite grad norm (nan)" and \
        _rollback(nan)[:4] == (10, 8, 2, [64, 79]), nan
    _same(run, ref)


@pytest.mark.slow  # make test's 12 minutes (Hugging Face conversion came in); the default
# tier's rollback: test_nan_on_one_rank_tp2pp2_rolls_back
def test_bad_batches_are_skipped_not_trained_on_again(reference_runs):
    """No injection: samples 75 and 108 are corrupt (NaN in their loss masks,
    --poison-train-samples), so whichever iteration reads one gets a NaN loss, however
    often. Iteration 10 reads samples 72-79: NaN, back to 8, and the default skip takes the
    batches of 9 and 10 (64-79), the bad one included; iteration 12 then reads 104-111:
    NaN, back to 10, batches of 11 and 12 skipped (96-111). Neither bad batch is met again
    (two rollbacks, every loss finite), and the run ends bit-identical to the spike test's
    reference, which skipped the same batches from the start and never read the bad ones."""
    layout = LAYOUTS["pp2dp2-zero1"]
    ref = reference_runs("pp2dp2-zero1-skip9x2-11x2", 4,
                         TINY + ITERS + layout + ["--skip-train-batches", "9:2,11:2"])
    run = torchrun(4, TINY + ITERS + layout + reft("arc,aor") +
                   ["--poison-train-samples", "75-75,108-108"]).check()
    assert "[FAULT]" not in run.output
    first, second = run.events_of("rollback")  # each bad batch met once
    # --reft-rollback-on nan with ZeRO-1 judges the job-wide grad norm alone (no
    # collective of its own, issue 57): the NaN loss made the gradients NaN
    assert first["reason"] == second["reason"] == "non-finite grad norm (nan)", \
        (first, second)
    assert _rollback(first)[:5] == (10, 8, 2, [64, 79], 1), first
    assert _rollback(second)[:5] == (12, 10, 2, [96, 111], 2), second
    assert (first["iterations"], second["iterations"]) == ([9, 10], [11, 12])
    assert "skipped 2 global batch(es) (iterations 9-10's, through the spiking one): " \
           "samples 64-79; rollback 1 of at most 3" in run.output
    assert all(math.isfinite(float.fromhex(v)) for v in run.losses.values())
    _same(run, ref)
