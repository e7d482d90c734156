"""What REFT adds to an iteration in collectives (issue 34): counted on a real 4-rank job
(REFT_COUNT_COLLECTIVES=1, reft_ext/testing/collectives.py), every call of REFT's code
into torch.distributed, with its group and bytes, per rank and iteration."""

from __future__ import annotations

from tests.harness.recovery import reft
from tests.harness.log_lines import assert_interval_lines, assert_one_fallback_line
from tests.harness.run import LAYOUTS, TINY, torchrun

ITERS, LOG = 8, 4
P2P = {"send", "recv", "isend", "irecv"}


def test_reft_collectives_per_iteration_and_their_groups():
    """PP2 x DP2 with the distributed optimizer, arc + aor, the loss-spike check on:
    in steady state the NaN verdict costs no collective (it reads the grad norm,
    already job-wide in megatron-core's distributed optimizer), the slowest
    rank's snapshot times are gathered job-wide only for the snapshots the log shows
    (--log-interval), and AOR's gradient shard goes to its one holder. The snapshot
    commit is local (--reft-keep 3): nothing world-wide on the other iterations."""
    args = [*TINY, "--train-iters", str(ITERS), *LAYOUTS["pp2dp2-zero1"], *reft("arc,aor"),
            "--log-interval", str(LOG), "--reft-keep", "3"]
    # PYTHONWARNINGS unset (the harness ignores warnings): the log `make run` shows
    run = torchrun(4, args, env={"REFT_COUNT_COLLECTIVES": "1", "PYTHONWARNINGS": ""}).check()
    its = {(e["rank"], e["iteration"]): e for e in run.events_of("reft_iteration")}
    assert sorted(its) == [(r, i) for r in range(4) for i in range(1, ITERS + 1)]
    holder_recvs = 0
    for (rank, it), e in its.items():
        assert e["reft_ms"] > 0, e
        if it == 1:  # start-up: REFT-load's agreement, AOR's seeding, the watcher
            continue
        # off the training thread: only AOR's holder, posting its own receive of the
        # owner's step on its apply thread (the training thread never waits for it)
        off = [c for c in e["calls"] if not c["training_thread"]]
        assert all((c["where"], c["op"]) == ("transport.py:_run", "irecv") for c in off), off
        holder_recvs += len(off)
        calls = [c for c in e["calls"] if c["training_thread"]]
        world = sorted({c["where"] for c in calls if c["group_size"] == 4 and
                        c["op"] not in P2P})
        # snapshot it - 1 is committed before the step of it; its line is a logged one
        logged = (it - 1) % LOG == 0
        assert world == (["snapshotter.py:_finish"] if logged else []), (rank, it, calls)
        # local commits (--reft-keep 3; auto above 16 nodes): no collective of any group
        assert not [c for c in calls if c["where"].startswith("commit.py")], calls
        # the NaN verdict reads megatron-core's grad norm, already reduced over the job by
        # the distributed optimizer: no collective of REFT's own (docs/has.md)
        verdict = [c for c in calls if c["where"] == "session.py:_job_wide"]
        assert verdict == [], calls
        aor = [c for c in calls if c["where"] == "transport.py:_on_step"]
        assert {c["op"] for c in aor} == {"isend"} and \
            all(c["group_size"] == 2 for c in aor), calls
    assert holder_recvs > 0
    # one [REFT] snapshots line per --log-interval, its maxima the slowest rank's (the
    # gather above); megatron-core's fallback warnings are one line (tests/harness/log_lines.py)
    assert_interval_lines(run.output, [(1, 4), (5, 8)])
    assert_one_fallback_line(run.output)
