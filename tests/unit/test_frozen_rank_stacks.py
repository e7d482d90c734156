"""A rank that does not stop after an abort is killed by the supervisor, and its threads'
stacks are in its log first: where it hung is what the user needs (found this way: a
survivor waiting in a lazily connected gloo pair, docs/scale.md)."""

from __future__ import annotations

import os
import textwrap

import pytest

from reft_ext.cluster.supervisor import Supervisor, SupervisorConfig
from tests.harness.run import REPO, wait_until

_RANK = textwrap.dedent("""
    import os, sys, time
    from reft_ext.cluster import inprocess

    gen = inprocess.Generation(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    open(os.path.join(sys.argv[1], f"up-{os.environ['RANK']}"), "w").close()

    def stuck_in_a_collective():  # the abort never reaches it
        time.sleep(600)

    stuck_in_a_collective()
""")


@pytest.mark.timeout(180)
def test_a_frozen_rank_writes_its_stacks_before_it_is_killed(tmp_path, capsys):
    out = tmp_path / "ranks"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    sup = Supervisor(SupervisorConfig(
        world_size=2, ranks_per_node=1, script=str(script), script_args=[str(out)],
        job_id="stacks-test", log_dir=str(tmp_path / "logs"), spares=2, max_restarts=1,
        abort_timeout=1.0, preload="", env={"PYTHONPATH": REPO}, cwd=REPO))
    try:
        sup.start()
        wait_until(lambda: all((out / f"up-{r}").exists() for r in (0, 1)), 90,
                   "the ranks to start")
        sup.kill_rank(1)
        wait_until(lambda: sup.history, 60, "a new generation")
        # rank 0 ignored the abort: killed as frozen, the same as dead
        assert sorted(sup.history[0]["dead"]) == [0, 1], sup.history
        log = open(os.path.join(sup.cfg.log_dir, "worker0.log")).read()
        assert "most recent call first" in log and "stuck_in_a_collective" in log, log
        said = capsys.readouterr().out
        assert "[0] did not stop within 1 s of the abort" in said, said
    finally:
        sup.close()
