"""A failure that repeats stops the job once, and a re-run finds its host memory (issue 59).

Real torchrun (python -m reft_ext.cluster.torchrun --standalone), real ranks, a real
full filesystem (a small tmpfs mounted for the test) and a real SIGKILL of the launcher.
The job id comes from the run's --save (reft_ext/cluster/run_id.py), as under `make run`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.harness.run import ENV_PATH, REPO, TINY, torchrun
from reft_ext.cluster import run_id
from reft_ext.store import paths

REFT = ["--global-batch-size", "4", "--reft-snapshot-every", "1", "--reft-protect", "arc",
        "--reft-ranks-per-node", "1"]


def _job_of(save: str) -> str:
    with open(os.path.join(save, run_id.FILE)) as f:
        return f.read().strip()


def test_bad_flag_under_the_reft_launcher_is_said_once_and_not_retried():
    out = torchrun(2, TINY + ["--train-iters", "3", "--no-such-flag"], max_restarts=3)
    assert out.returncode == 2
    line = ("error: unrecognized arguments: --no-such-flag (python pretrain_llama.py --help "
            "lists the flags)")
    assert out.output.count(line) == 1, out.output
    assert "usage:" not in out.output and "Traceback" not in out.output
    assert out.output.count("failed (exitcode: 2)") <= 1  # one attempt: no restart
    # a flag combination refused by validation: the same
    out = torchrun(2, TINY + ["--train-iters", "3", "--global-batch-size", "4",
                              "--tensor-model-parallel-size", "2", "--reft-snapshot-every",
                              "1", "--reft-protect", "arc"], max_restarts=3)
    assert out.returncode == 2
    errors = [ln for ln in out.output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "--reft-protect" in errors[0], out.output
    assert "Traceback" not in out.output


def _tmpfs(size: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tempfile.mkdtemp(prefix="reft-full-", dir="/tmp")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                       d]).returncode:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs here")
    return d


def _unmount(d: str) -> None:
    subprocess.run(["umount", "-l", d])
    os.rmdir(d)


@pytest.fixture
def small_disk():
    """An 8 MiB tmpfs: three checkpoints of the tiny model fit, the fourth does not."""
    d = _tmpfs("8m")
    yield d
    _unmount(d)


def test_save_without_space_for_one_checkpoint_is_refused_at_start():
    d = _tmpfs("1m")
    try:
        out = torchrun(2, TINY + REFT + ["--train-iters", "3", "--save",
                                         os.path.join(d, "ckpt")], max_restarts=3)
    finally:
        _unmount(d)
    assert out.returncode == 2
    errors = [ln for ln in out.output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "one checkpoint of this model takes about" in errors[0], \
        out.output[-3000:]
    assert "iteration        1/" not in out.output and "Traceback" not in out.output


@pytest.mark.slow  # two runs of ~15 s each
def test_full_save_disk_stops_once_and_a_rerun_resumes_from_host_memory(small_disk):
    save = os.path.join(small_disk, "ckpt")
    args = TINY + REFT + ["--train-iters", "10", "--save", save, "--load", save,
                          "--save-interval", "2"]
    first = torchrun(2, args, max_restarts=3)
    assert first.returncode == 3, first.output[-4000:]
    errors = [ln for ln in first.output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, first.output[-6000:]
    assert f"--save {save}: no space left for the checkpoint of iteration 8" in errors[0]
    job = _job_of(save)
    assert paths.job_parent("/dev/shm", job) in errors[0]
    assert "Traceback" not in first.output
    assert "recovered iteration" not in first.output  # one attempt: no restart
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == \
        ["iter_0000002", "iter_0000004", "iter_0000006"]  # no .refused copies
    assert f"[REFT] host memory of job {job} kept" in first.output
    for it in (2, 4):  # space freed
        shutil.rmtree(os.path.join(save, f"iter_{it:07d}"))
    again = torchrun(2, args, max_restarts=3).check()
    assert again.events_of("recovered", rank=0, source="own"), again.output[-4000:]
    assert "saved checkpoint at iteration       8" in again.output
    assert _job_of(save) == job
    assert not os.path.exists(paths.job_parent("/dev/shm", job))  # nothing left behind


@pytest.mark.slow  # ~30 s
def test_rerun_after_sigkill_of_the_launcher_finds_its_host_memory(tmp_path):
    save = str(tmp_path / "ckpt")
    args = TINY + REFT + ["--save", save, "--load", save, "--save-interval", "1000"]
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=2", "--max-restarts=1", os.path.join(REPO, "pretrain_llama.py")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **ENV_PATH)
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd + args + ["--train-iters", "400"], cwd=REPO, env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while "iteration       12/" not in log.read_text():
            assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGKILL)  # the launcher alone; its ranks follow it
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    job = _job_of(save)
    parent = paths.job_parent("/dev/shm", job)
    deadline = time.time() + 60
    from reft_ext.cluster import leftovers
    while leftovers.users(parent):  # the ranks die with their agent (PDEATHSIG)
        assert time.time() < deadline, f"ranks outlived their launcher: {leftovers.users(parent)}"
        time.sleep(0.2)
    assert os.path.isdir(os.path.join(parent, "node0"))  # the host memory stays
    again = torchrun(2, args + ["--train-iters", "20"]).check()
    rec = again.events_of("recovered", rank=0, source="own")
    assert rec and rec[0]["iteration"] >= 12, again.output[-4000:]
    assert not os.path.exists(parent)  # the normal end removed it: no stale segment
