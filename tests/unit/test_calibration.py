"""--reft-calibrate-iters (reft_ext/report/calibration.py): snapshots skipped in every
other block of 4, each iteration's time booked to the block of the snapshot it carried,
the block's first one left out, the ratio of the medians."""

import pytest

from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.report.calibration import BLOCK, WARMUP, Calibration


def test_blocks_alternate_and_the_ratio_is_of_the_blocks_with_snapshots():
    cal = Calibration(8, first=1)  # 2 blocks: iterations 6-9 off, 10-13 on
    start = 1 + WARMUP
    assert (cal.start, cal.end) == (start, start + 2 * BLOCK - 1)
    due = {i: cal.snapshot_due(i) for i in range(1, 17)}
    assert [i for i, d in due.items() if not d] == [6, 7, 8, 9]
    over = []
    for i in range(2, 17):
        # an iteration carrying a snapshot (of the iteration before) takes 0.11 s
        over.append(cal.observe(i, 0.11 if due[i - 1] else 0.10))
    assert over.index(True) == 14 - 2 and over.count(True) == 1  # iteration 14: done
    r = cal.result()
    assert r["counted"] == 6 and r["ratio"] == pytest.approx(1.1)
    assert "snapshots slow training by +10.0%" in cal.text()


def test_odd_sizes_round_up_to_pairs_of_blocks_and_the_flag_is_checked():
    assert Calibration(1, first=10).end - Calibration(1, first=10).start + 1 == 2 * BLOCK
    assert Calibration(13, first=1).end - Calibration(13, first=1).start + 1 == 4 * BLOCK
    with pytest.raises(ReftConfigError, match="--reft-calibrate-iters"):
        ReftConfig(calibrate_iters=-1)
