"""The CPU twin of tools/gpu_multirank.py (several ranks on one GPU, a step of
tools/gpu_lease.sh): the same driver, cases and flags on gloo with host tensors. A lost
node under aec,aor and a crash end with final checkpoints identical to the failure-free
run's (tools/compare_checkpoints.py), and each fault really fired and was recovered from
host memory. (tests/integration/test_nodes.py's aec,aor node loss is the same layout
through the test harness.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness.run import REPO

pytestmark = pytest.mark.slow  # three 4-rank jobs, one with a replaced node (~2 min)


def test_cpu_twin_of_the_device_cases_recovers_bit_exactly(tmp_path):
    out = tmp_path / "mr"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_multirank.py"),
                        "--device", "cpu", "--out", str(out), "--cases",
                        "ref,lost-aec,crash", "--timeout", "240"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert table.count("| identical |") == 2, table
    lost = (out / "lost-aec" / "output.log").read_text()
    assert "[FAULT] injecting SIGSTOP into rank 2" in lost
    assert "recovered iteration 3 on rank 2 from" in lost and "AOR replica" in lost
    crash = (out / "crash" / "output.log").read_text()
    assert "[FAULT]" in crash and "recovered iteration 3 on rank 1 from own memory" in crash
