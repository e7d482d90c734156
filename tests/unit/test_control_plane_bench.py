"""benchmarks/bench_control_plane.py's smallest case as a harness check: 16 simulated
ranks lose a node through the real supervisor, signed store, Generation protocol and
REFT-load plan; every phase is measured and every rank ends agreeing (same generation,
same plan digest). Timings are not asserted."""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_control_plane as bench  # noqa: E402

from reft_ext.plan.cli import plan  # noqa: E402


def test_smallest_case_measures_every_phase_and_agrees():
    args = argparse.Namespace(ranks_per_node=8, timeout=120)
    r = bench.run_one(16, "node", "lazy", args)
    assert r["agreed"] and r["generation"] == 1 and r["dead"] == list(range(8, 16))
    for phase in bench.STORE_PHASES + ("inventory", "planning"):
        assert r["seconds"][phase] > 0, phase
    for phase in bench.COUNTED:
        assert bench.ops(r, phase)[0] > 0, phase
    # TP8 x DP2: a rank connects to its ring neighbours and its group's other member
    assert r["layout"] == [8, 1, 2] and r["peers_max"] <= 3 and r["sends_max"] > 0
    assert "16384" in bench.report([r], argparse.Namespace(
        collective_latency=30e-6, ranks_per_node=8), 0.0)


def test_planner_prints_recovery_at_world_sizes():
    argv = ["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "8", "--data-parallel-size", "16",
            "--hardware", "H100", "--reft-protect", "arc", "--world-sizes", "1024,16384"]
    rep = plan(argv)
    text = rep.render()
    assert "Recovery at scale" in text and "TrainMover" in text
    rows = rep.to_dict()["recovery_at_scale"]
    assert [x["world_size"] for x in rows] == [1024, 16384]
    assert rows[0]["control_plane_s"] < rows[1]["control_plane_s"]
    assert all(0 < x["goodput"] < 1 for x in rows)
