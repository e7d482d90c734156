"""The log a person reads (issue 36): `--reft-log-every-snapshot` brings back one
``[REFT] snapshot iteration i`` line per snapshot, and megatron-core's fallback warnings
are one line from rank 0. The default, one ``[REFT] snapshots`` line per --log-interval,
is checked on test_reft_collectives.py's 4-rank job (no run of its own: the default tier
is at its time budget), the flag also on test_has.py's."""

from __future__ import annotations

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
