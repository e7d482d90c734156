"""HAS: snapshots copied in pipeline bubbles and beside compute are bit-identical to
end-of-iteration snapshots of the same iteration (1F1B and interleaved), training is
unchanged by them, and the Chrome trace covers every rank and iteration."""

import json
import re

import pytest

from tests.harness.log_lines import every_snapshot_lines
from tests.harness.run import LAYOUTS, TINY, torchrun

REFT = ["--reft-snapshot-every", "1", "--reft-ranks-per-node", "1"]
PP2DP2 = LAYOUTS["pp2dp2"]
ITERS = 6
ZERO1 = LAYOUTS["pp2dp2-zero1"]


def _checks(run, nranks):
    found = re.findall(r"\[HAS-CHECK\] rank (\d+) identical (\d+) bubble (\d+) compute "
                       r"(\d+) drain (\d+)", run.output)
    assert sorted(int(r) for r, *_ in found) == list(range(nranks)), run.output[-4000:]
    return {int(r): tuple(map(int, rest)) for r, *rest in found}


def test_seams_megatron_core_still_has():
    from megatron.training.pipeline_events import check_seams

    assert check_seams() == []


def test_has_1f1b_zero1_aec_matches_end_of_iteration_and_reference(reference_runs):
    args = TINY + ["--train-iters", str(ITERS)] + ZERO1
    # (--reft-log-every-snapshot: this default-tier run also shows one line per snapshot)
    run = torchrun(4, args + REFT + ["--reft-protect", "aec", "--reft-schedule", "has",
                                     "--reft-log-every-snapshot"],
                   script="tests/workers/has_worker.py").check()
    assert every_snapshot_lines(run.output) == list(range(1, ITERS + 1))
    checks = _checks(run, 4)
    for rank, (n, bubble, compute, drain) in checks.items():
        assert n == ITERS  # every snapshot compared, the last one flushed at exit
    # the bubbles really carried snapshot bytes (not everything waited for the step)
    assert sum(c[1] for c in checks.values()) > 0
    # and training itself is bit-identical to a run without snapshots
    ref = reference_runs("pp2dp2-zero1", 4, args)  # shared with test_reft_recovery
    assert run.hashes == ref.hashes and run.losses == ref.losses  # (a worker: no checkpoint)


@pytest.mark.slow  # 3 job runs; the 1F1B test above is the default tier's HAS check
def test_interleaved_has_and_host_thread_match_end_of_iteration_with_trace(tmp_path):
    args = TINY + PP2DP2 + ["--num-layers-per-virtual-pipeline-stage", "1",
                            "--train-iters", str(ITERS)]
    trace = tmp_path / "trace.json"
    has = torchrun(4, args + REFT + ["--reft-protect", "arc", "--reft-trace-file", str(trace)],
                   script="tests/workers/has_worker.py").check()
    assert all(c[0] == ITERS for c in _checks(has, 4).values())
    host = torchrun(4, args + REFT + ["--reft-protect", "arc", "--reft-schedule",
                                      "host-thread"], script="tests/workers/has_worker.py").check()
    assert all(c[0] == ITERS and c[1] == 0 for c in _checks(host, 4).values())
    assert has.hashes == host.hashes and has.losses == host.losses

    doc = json.loads(trace.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        mine = [e for e in events if e["pid"] == rank]
        for it in range(1, ITERS + 1):
            names = {e["name"] for e in mine if e["args"].get("iteration") == it}
            # 2 micro-batches per DP rank x 2 model chunks, forward and backward
            for phase in ("forward-compute", "backward-compute"):
                n = sum(e["name"] == phase and e["args"]["iteration"] == it for e in mine)
                assert n == 4, (rank, it, phase, n)
            assert {"backward-compute", "optimizer-step", "snapshot-commit"} <= names
            assert any("recv" in n or "send" in n for n in names)  # the named p2p waits
            units = [e for e in mine if e["tid"] == "snapshot" and e["args"]["iteration"] == it]
            assert units and {e["cat"] for e in units} <= {"snapshot-bubble",
                                                           "snapshot-compute", "snapshot-drain"}
    waits = [e for e in events if e["cat"] == "p2p-wait"]
    assert {e["pid"] for e in waits} == {0, 1, 2, 3}
    written = has.events.one("trace")
    assert (written["ranks"], written["path"]) == (4, str(trace)), written
