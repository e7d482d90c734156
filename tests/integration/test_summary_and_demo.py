"""The end-of-run REFT summary, the job-wide recovery tier, `make demo`'s digest and the
deferred megatron-core jit_fuser, without torchrun (the end-to-end runs that print them
are in test_reft_recovery.py and test_aor_recovery.py)."""

import os
import re
import subprocess
import sys

import pytest

from reft_ext.report import summary
from reft_ext.load.recover import recovery_tier

from tests.harness.run import REPO
from tools import demo


def test_counters_survive_in_the_state_and_the_summary_names_them():
    extra = {}
    for _ in range(5):
        summary.count_snapshot(extra)
    summary.count_recovery(extra, "own memory")
    summary.count_recovery(extra, "ARC replica + AOR replica")
    summary.count_recovery(extra, "own memory")
    line = summary.format_summary(
        extra=extra, every=1, regions={"own": 2**20, "arc": 2**20, "owned": 0, "aor": 2**19},
        blocked_s=[0.001, 0.002, 0.010], iteration_s=[0.2, 0.1, 0.3], protection="arc,aor",
        host_bytes_per_node=3 * 2**20, nodes=4, hooks=(0.48, 60, 4, 0.12))
    assert line.startswith("summary: 5 snapshots (every 1 iteration, --reft-protect arc,aor)")
    assert "2.50 MiB per rank (own 1.00, arc 1.00, aor 0.50 MiB)" in line
    # the hooks' wall time (goodput's snapshot) is the cost; the copy wait a part of it
    assert "REFT's hooks 8.00 ms per iteration (mean of 4 ranks), of it 2.00 ms waiting " \
           "for the slowest rank in the job-wide commit" in line
    assert "and 6.00 ms REFT's work (goodput's \"snapshot\": 0.09 s per rank in this " \
           "process), 3.00% of the median iteration (200.0 ms)" in line
    assert "of it training blocked on the copy 2.00 ms per snapshot (median)" in line
    assert "not measured by the job (--reft-calibrate-iters N measures it), python " \
           "benchmarks/bench_overhead.py measures it" in line
    cal = {"first": 6, "last": 13, "with_ms": 110.0, "without_ms": 100.0, "ratio": 1.1,
           "counted": 6}
    measured = summary.format_summary(
        extra=extra, every=1, regions={"own": 2**20}, blocked_s=[0.001], iteration_s=[0.1],
        protection="arc", host_bytes_per_node=2**20, nodes=1, hooks=(0.1, 10, 1),
        calibration=cal)
    assert "slowdown against no snapshots: +10.0% (--reft-calibrate-iters, iterations " \
           "6-13: 110.0 vs 100.0 ms median;" in measured and "not measured" not in measured
    assert "recoveries: 2 from own memory, 1 from ARC replica + AOR replica" in line
    assert line.endswith("host memory 3.00 MiB per node (4 nodes)")
    assert "recoveries: none" in summary.format_summary(
        extra={}, every=2, regions={"own": 1}, blocked_s=[], iteration_s=[], nodes=1,
        protection="arc", host_bytes_per_node=2)


def _inv(own=True, red=True, owned=True, aor=False, aor_owner=None):
    return {7: {"slot": 0, "ok": {"own": own, "redundancy": red, "owned": owned, "aor": aor},
                "aor_owner": aor_owner}}


def test_recovery_tier_is_the_same_job_wide_answer():
    groups = [[0, 2], [1, 3]]
    invs = [_inv(), _inv(), _inv(), _inv()]
    plans = {0: {0: "own", 1: "own"}, 1: {0: "own", 1: "own"}}
    assert recovery_tier(invs, groups, 7, plans, owned_needed=True) == "own memory"
    # rank 3 lost its node: slice from rank 1's ARC replica, shard from rank 1's AOR replica
    invs[3] = {}
    invs[1] = _inv(aor=True, aor_owner=3)
    plans[1] = {0: "own", 1: "replica"}
    assert recovery_tier(invs, groups, 7, plans, owned_needed=True) == \
        "ARC replica + AOR replica"
    assert recovery_tier(invs, groups, 7, {0: {0: "parity", 1: "own"}}, owned_needed=False) \
        == "AEC parity"


LOG = """\
[REFT] snapshot iteration 4: 1 bytes
[FAULT] injecting SIGKILL into rank 1 (pid 5) at iteration 5
[REFT] recovery: iteration 4 restored on 4 ranks from own memory in 16.7 ms
[REFT] snapshot iteration 4: 1 bytes
[REFT] snapshot iteration 5: 1 bytes
 [t] iteration        6/      12 | consumed samples: 1 | lm loss: 4.5E+00 (of iterations 5-6 only) | loss scale: 1.0 |
 [t] iteration       12/      12 | consumed samples: 1 | lm loss: 4.402466E+00 | loss scale: 1.0 | grad norm: 2
[HASH] rank 0 iteration 12 state ab
[HASH] rank 1 iteration 12 state cd
"""
REF = """\
 [t] iteration        6/      12 | consumed samples: 1 | lm loss: 4.6E+00 | loss scale: 1.0 |
 [t] iteration       12/      12 | consumed samples: 1 | lm loss: 4.402466E+00 | loss scale: 1.0 |
[HASH] rank 0 iteration 12 state ab
[HASH] rank 1 iteration 12 state cd
"""


def test_demo_digest_and_comparison(tmp_path):
    """The loss of the iterations both runs logged over a whole interval is compared
    (iteration 6's line after the restart averages 5-6 only: named, not compared), and
    the hashes; the label names the failure-free run's directory."""
    lines = [(float(i), line) for i, line in enumerate(LOG.splitlines())]
    text = "\n".join(demo.digest(lines))
    assert "- crash: SIGKILL to rank 1 in iteration 5" in text
    assert "REFT-load: iteration 4 from own memory in 17 ms (lost work: 0" in text
    assert "training again 3.0 s after the fault (next iteration committed: 5)" in text
    ref = tmp_path / "reference" / "train.log"
    ref.parent.mkdir()
    ref.write_text(REF)
    report, same = demo.compare(lines, str(ref))
    assert same, report
    assert report[0] == (f"- lm loss of the 1 logged iterations both runs averaged over a "
                         f"whole interval: identical (iteration 12: this run 4.402466E+00, "
                         f"failure-free run ({ref.parent}) 4.402466E+00)"), report
    assert report[1] == ("  not compared: iteration 6 (this run's line averages iterations "
                         "5-6 only, those since its restart)"), report
    assert "bit-identical to the failure-free run" in report[2]
    ref.write_text(REF.replace("state cd", "state ce"))
    report, same = demo.compare(lines, str(ref))
    assert not same and "DIFFERENT to the failure-free" in report[-1]
    ref.write_text(REF.replace("4.402466E+00", "4.402467E+00"))
    report, same = demo.compare(lines, str(ref))
    assert not same and ": DIFFERENT (iteration 12" in report[0], report
    assert not demo.compare(lines, str(tmp_path / "none"))[1]


def test_demo_reference_is_its_own_per_set_of_flags():
    """The failure-free run is the demo's own, keyed by the flags without the faults
    (never `make run`'s directory, which a second `make run` rewrites)."""
    a = demo.reference_dir("runs/demo-reference", 4, ["--train-iters", "40",
                                                       "--inject-fault", "1:5"])
    assert a == demo.reference_dir("runs/demo-reference", 4,
                                   ["--train-iters", "40", "--inject-fault=2:7:KILL:node"])
    assert a.startswith("runs/demo-reference-")
    assert a != demo.reference_dir("runs/demo-reference", 4, ["--train-iters", "41"])
    assert a != demo.reference_dir("runs/demo-reference", 2, ["--train-iters", "40"])


def test_megatron_jit_fuser_is_compiled_on_first_call_only():
    """Importing the trainer no longer imports torch._dynamo (megatron-core's fusions are
    decorated with torch.compile at import); a deferred kernel still compiles and runs."""
    code = (
        "import sys, torch\n"
        "import megatron.training.training\n"
        "from megatron.core import jit\n"
        "from megatron.training.lazy_jit import lazy_compile\n"
        "assert jit.jit_fuser is lazy_compile, jit.jit_fuser\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "f = jit.jit_fuser(lambda x: x * 2 + 1, backend='eager')\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "x = torch.arange(4.0)\n"
        "assert torch.equal(f(x), x * 2 + 1)\n"
        "assert 'torch._dynamo' in sys.modules\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.slow  # three 2-rank jobs (the reference once, the demo twice)
def test_demo_twice_in_a_row_reports_identical(tmp_path):
    """tools/demo.py as `make demo` runs it, twice: the first makes its failure-free
    reference (its own directory, keyed by the flags), the second reuses it; both report
    the hashes, the loss of the iterations logged over a whole interval and the final
    checkpoint identical. The crash in iteration 6 (restored: 5) leaves the line of
    iteration 8 averaging 6-8 only: it says so and is not compared."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "8", "--lr-warmup-iters", "1", "--log-interval", "4",
             "--eval-iters", "0", "--use-distributed-optimizer", "--log-params-hash",
             "--reft-snapshot-every", "1", "--reft-protect", "arc,aor",
             "--reft-ranks-per-node", "1", "--inject-fault", "1:6"]
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    cmd = [sys.executable, "tools/demo.py", "--run-dir", str(tmp_path / "demo"), "--nproc",
           "2", "--reference-dir", str(tmp_path / "demo-reference"), "--", *flags]
    outs = []
    for _ in range(2):
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=env)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        outs.append(p.stdout)
    ref = demo.reference_dir(str(tmp_path / "demo-reference"), 2, flags)
    assert f"== failure-free reference: {ref} (once per set of flags) ==" in outs[0]
    assert f"== failure-free reference: {ref} (made before with the same flags) ==" in outs[1]
    for out in outs:
        assert "- crash: SIGKILL to rank 1 in iteration 6" in out, out[-3000:]
        assert re.search(r" iteration +8/ +8 \|.*lm loss: \S+ \(of iterations 6-8 only\) \|",
                         out), out[-3000:]
        assert (f"- lm loss of the 1 logged iterations both runs averaged over a whole "
                f"interval: identical (iteration 4: ") in out, out[-3000:]
        assert "not compared: iteration 8 (this run's line averages iterations 6-8 only" in out
        assert f"bit-identical to the failure-free run ({ref})" in out
        assert "- final checkpoint identical to the failure-free run's" in out
