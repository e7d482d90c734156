"""The planner's model of REFT at scale (reft_ext/plan/scale.py): the collectives REFT
issues per iteration by group, what --reft-keep 2's job-wide commit adds, and the CLI's
table, JSON and comparison with the paper's figures."""

from __future__ import annotations

import json

import pytest

from reft_ext.plan import plan
from reft_ext.plan.cli import main
from reft_ext.plan.common import PlanConfigError
from reft_ext.plan.scale import ScaleConfig, at_scale, reft_collectives, ring_allreduce

FRONTIER = ["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "4", "--data-parallel-size", "16",
            "--use-distributed-optimizer", "--global-batch-size", "256",
            "--hardware", "MI250X", "--reft-protect", "arc,aor"]


def test_ring_allreduce_is_latency_bound_for_small_messages():
    assert ring_allreduce(1, 8, 30e-6, 1e9) == 0.0
    assert ring_allreduce(4, 8, 30e-6, 1e9) == pytest.approx(6 * 30e-6 + 1.5 * 8 / 1e9)
    # the job-wide all-reduce at 16384 ranks: about a second per call
    assert 0.9 < ring_allreduce(16384, 8, 30e-6, 1e9) < 1.1


def test_inventory_matches_the_code_local_commits_add_nothing_job_wide():
    p = plan(FRONTIER).plan
    local = {c["what"]: c for c in reft_collectives(p, ScaleConfig(), 4096, 128)}
    assert not any("commit" in w for w in local)
    assert local["loss-spike/NaN verdict"]["group"] == "pipeline"
    assert local["loss-spike/NaN verdict"]["group_size"] == 4
    stats = local["snapshot line's slowest-rank times"]
    assert (stats["group_size"], stats["per_iteration"]) == (4096, 1 / 100)
    aor = local["AOR gradient shard to its holder (next node)"]
    assert not aor["training_thread"] and aor["bytes"] > 0
    jobwide = reft_collectives(p, ScaleConfig(), 4096, 128, keep=2)
    commit = [c for c in jobwide if "commit" in c["what"]]
    assert [(c["group_size"], c["per_iteration"]) for c in commit] == [(4096, 1.0)]


def test_reft_per_iteration_time_stays_flat_with_local_commits_grows_without():
    p = plan(FRONTIER).plan
    local = [at_scale(p, ScaleConfig(), w)["collectives_s"] for w in (512, 4096, 16384)]
    jobwide = [at_scale(p, ScaleConfig(), w, keep=2)["collectives_s"]
               for w in (512, 4096, 16384)]
    # local: the verdict over 4 pipeline stages, + the statistics once per 100 iterations
    assert local[2] < 0.02 and jobwide[2] > 0.9
    assert jobwide[2] / jobwide[0] > 20


def test_world_sizes_table_and_json():
    rc_text = plan(FRONTIER + ["--world-sizes", "512,4096"]).render()
    assert "REFT at scale (TP 8 x PP 4, DP grows; --reft-keep auto" in rc_text
    assert "| 4096 | 128 |" in rc_text
    d = plan(FRONTIER + ["--world-sizes", "512,4096", "--json"]).to_dict()
    assert [r["world_size"] for r in d["scale"]] == [512, 4096]
    assert d["scale"][0]["world_collectives_per_iteration"] == pytest.approx(0.01)
    with pytest.raises(PlanConfigError, match="--world-sizes: 100 is not a multiple"):
        plan(FRONTIER + ["--world-sizes", "100"])
    with pytest.raises(PlanConfigError, match="--reft-keep: must be >= 2"):
        plan(FRONTIER + ["--reft-keep", "1"])


def test_paper_check_prints_every_reported_figure(capsys):
    assert main(["--paper-check", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["paper"] for r in rows] == pytest.approx([0.01, 6.32 / 6.26 - 1, 0.006,
                                                        0.84, 0.75])
    assert all(r["planner"] > 0 for r in rows)
