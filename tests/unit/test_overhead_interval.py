"""bench_overhead's verdict: the median of the rounds' paired ratios with a
distribution-free interval (benchmarks/overhead_jobs.py), so a figure within the host's
noise reads as undecided, not as met or missed."""

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import overhead_jobs as oj  # noqa: E402


def test_the_interval_is_the_order_statistics_of_the_sign_test():
    xs = [1.0 + i / 100 for i in range(8)]
    lo, hi, conf = oj.median_interval(list(reversed(xs)))
    # 8 rounds: x_(2)..x_(7) covers the median with 1 - 2 * 9/256 = 93%
    assert (lo, hi) == (1.01, 1.06) and math.isclose(conf, 1 - 18 / 256)
    lo, hi, conf = oj.median_interval(xs[:3])  # too few rounds: all of them, and says so
    assert (lo, hi) == (1.0, 1.02) and conf == 0.75


def test_the_interval_covers_the_true_median_as_often_as_it_says():
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        lo, hi, conf = oj.median_interval([rng.gauss(1.04, 0.05) for _ in range(12)])
        hits += lo <= 1.04 <= hi
    assert abs(hits / 2000 - conf) < 0.03 and conf >= 0.90


def _res(paired):
    return {"paired": {"reft": paired}}


def test_the_verdict_reads_met_missed_or_undecided():
    assert oj.verdict(_res([1.00, 1.01, 1.02, 1.01, 1.00, 1.02]), "reft", 1.03) \
        .endswith("target <= 1.03 met")
    assert oj.verdict(_res([1.05, 1.06, 1.07, 1.05, 1.08, 1.06]), "reft", 1.03) \
        .endswith("target <= 1.03 not met")
    line = oj.verdict(_res([1.12, 1.03, 1.013, 1.04, 1.115, 0.91, 1.037, 1.086]), "reft", 1.03)
    assert line.startswith("1.038,") and "93% interval 1.013-1.115 over 8 rounds" in line
    assert line.endswith("not decided at this noise (more rounds)")
    assert oj.verdict(_res([1.10, 1.12, 1.09, 1.15, 1.11, 1.2]), "reft", 1.08, above=True) \
        .endswith("target >= 1.08 met")


def test_the_in_job_figure_is_read_from_the_jobs_own_calibration_line():
    # the line reft_ext/report/calibration.py prints, as the job's log carries it
    from reft_ext.report.calibration import Calibration

    cal = Calibration(16, 1)
    for it in range(1, cal.end + 2):
        cal.observe(it, 0.33 if cal.snapshot_due(it - 1) else 0.30)  # (carried: i-1)
    line = f"[REFT] {cal.text()}"
    assert abs(oj.calibration_ratio("some log\n" + line + "\nmore") - 1.1) < 1e-9
    with pytest.raises(ValueError, match="calibration"):
        oj.calibration_ratio("[REFT] snapshots ... (no calibration line)")
    table = oj.in_job_table("default", {"paired": {"reft": [1.02, 1.03, 1.01, 1.02]},
                                        "nproc": 4}, "1.0")
    assert "| reft | 1.020" in table and "reft in the job (snapshots alone): 1.020" in table
