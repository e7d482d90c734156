"""The log a person reads (issue 36): `--reft-log-every-snapshot` brings back one
``[REFT] snapshot iteration i`` line per snapshot, and megatron-core's fallback warnings
are one line from rank 0; Megatron-LM's dataset lines and TensorBoard names, the [REFT]
line of ZeRO-1 shards left bare, a re-run of a finished job (issue 59, slow; the default
tier checks the first three on test_first_screen.py's `make run`). The default, one
``[REFT] snapshots`` line per --log-interval, is checked on test_reft_collectives.py's
4-rank job (no run of its own: the default tier is at its time budget), the flag also on
test_has.py's."""

from __future__ import annotations

import re

import pytest

from tests.harness.log_lines import EACH, assert_one_fallback_line, every_snapshot_lines
from tests.harness.recovery import reft
from tests.harness.run import TINY, torchrun

# no --log-params-hash: no final checkpoint to write (tests/harness/oracle.py)
SHORT = [a for a in TINY if a not in ("--log-params-hash", "--log-loss-history")]


@pytest.mark.slow  # a 2-rank run; the default tier: test_has.py's run with the flag, the
# unit tests (tests/unit/test_snapshot_log.py) and test_reft_collectives.py's log
def test_every_snapshot_flag_prints_one_line_per_snapshot():
    """DP2, 4 iterations, --log-interval 2: four snapshot lines, the slowest rank's times
    on the logged iterations (2, 4: the job-wide gather) and rank 0's on the others;
    every snapshot is in the events file either way, no interval line or event."""
    args = [*SHORT, "--train-iters", "4", "--global-batch-size", "4", *reft("none"),
            "--log-interval", "2", "--reft-log-every-snapshot"]
    run = torchrun(2, args, env={"PYTHONWARNINGS": ""}).check()
    assert every_snapshot_lines(run.output) == [1, 2, 3, 4]
    assert [m[2] for m in EACH.finditer(run.output)] == \
        ["rank 0", "slowest rank", "rank 0", "slowest rank"]
    assert "[REFT] snapshots of" not in run.output and not run.events_of("snapshot_interval")
    assert [e["iteration"] for e in run.events_of("snapshot")] == [1, 2, 3, 4]
    assert_one_fallback_line(run.output)


def tensorboard_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every TensorBoard event file under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.mark.slow  # two 2-rank runs; the default tier: test_first_screen.py's `make run`
# (the table, the dataset lines, the TensorBoard names, the bare-shards line)
def test_megatron_log_and_tensorboard_names_zero1_bare_shards_and_a_finished_rerun(tmp_path):
    """DP2 ZeRO-1 under --reft-protect arc, 2 iterations, then the same command again.
    The first run: one [REFT] line says the optimizer shards are bare (what a node loss
    costs, how to cover them); the argument table shows the backend the run uses;
    Megatron-LM's dataset lines with sample counts; TensorBoard under Megatron-LM's
    scalar names, each also "vs samples", iteration-time in seconds. The re-run finds
    the job finished: one line, no summary, no goodput, nothing trained."""
    save, tb = str(tmp_path / "ckpt"), tmp_path / "tb"
    args = [*SHORT, "--train-iters", "2", "--lr-warmup-iters", "1", "--global-batch-size", "4",
            "--use-distributed-optimizer", *reft("arc"), "--eval-interval", "2",
            "--eval-iters", "1", "--save", save, "--load", save, "--tensorboard-dir", str(tb)]
    run = torchrun(2, args).check()
    out = run.output
    bare = [line for line in out.splitlines() if "ZeRO-1 optimizer shards unprotected" in line]
    assert len(bare) == 1 and bare[0].startswith("[REFT] ") and \
        "a lost node costs the persistent checkpoint" in bare[0] and \
        "--reft-protect arc,aor covers them" in bare[0], bare or out[:4000]
    assert run.events_of("owned_unprotected")
    assert re.search(r"^  distributed_backend \.+ gloo$", out, re.M), out[:6000]
    assert ("> building train, validation, and test datasets ...\n"
            " > datasets target sizes (minimum size):\n"
            "    train:      8\n    validation: 8\n    test:       4\n") in out, out[:8000]
    assert "> finished creating GPT datasets ..." in out
    tags = tensorboard_scalars(tb)
    for name in ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm"):
        assert [s for s, _ in tags[name]] == [1, 2], (name, sorted(tags))
        assert [s for s, _ in tags[f"{name} vs samples"]] == [4, 8], name
    assert tags["batch-size"][0][1] == 4 and tags["loss-scale"][0][1] == 1.0
    for name in ("lm loss validation", "lm loss validation ppl"):
        assert [s for s, _ in tags[name]] == [2] and \
            [s for s, _ in tags[f"{name} vs samples"]] == [8], name
    assert 0 < tags["iteration-time"][0][1] < 60  # seconds, as Megatron-LM writes it
    assert "iteration-time-ms" not in tags
    again = torchrun(2, args).check().output
    assert "already at --train-iters 2: the loaded state is at it, nothing to train" in again
    for absent in ("[REFT] summary", "goodput", " iteration        1/"):
        assert absent not in again, (absent, again[-3000:])
