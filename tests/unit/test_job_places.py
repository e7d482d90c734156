"""The job's identity and its places (issues 59 and 60): the run's job id kept in its
--save, /dev/shm under the job's private parent, Slurm's secret job id and bound port,
and `make run`'s log (tools/run_log.py). Attacks by a second user (nobody, via setpriv)
are made for real and asserted made."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from reft_ext.cluster import run_id
from reft_ext.cluster import leftovers
from reft_ext.store import paths
from reft_ext.store.shm import ShmSegment
from tests.harness.run import ENV_PATH, REPO
from tests.unit.test_safe_paths import NOBODY, PY, SETPRIV, needs_setpriv

STANDIN = os.path.join(REPO, "tests", "harness", "slurm_standin")


def nobody(*cmd, check=False):
    return subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                           "--clear-groups", *cmd], capture_output=True, text=True,
                          timeout=30, check=check)


@pytest.fixture
def shm():
    """A sticky, world-writable directory on the tmpfs, as /dev/shm is."""
    d = os.path.join("/dev/shm", f"reft-places-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(d)
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- the run's job id ------------------------------------------------------------------
def test_job_id_is_kept_while_its_host_memory_is_there(tmp_path, shm):
    save = str(tmp_path / "ckpt")
    first, how = run_id.for_run(save, shm)
    assert first.startswith("run-") and "kept in" in how
    f = os.path.join(save, run_id.FILE)
    assert os.stat(f).st_mode & 0o777 == 0o600 and open(f).read().strip() == first
    # nothing in host memory (a normal end removed it): a fresh id, never the seen one
    second, _ = run_id.for_run(save, shm)
    assert second != first and open(f).read().strip() == second
    ShmSegment.create(paths.domain(second, 0), "rank0.committed", 8, base_dir=shm).close()
    assert run_id.for_run(save, shm)[0] == second  # a re-run finds its memory
    assert os.stat(paths.job_parent(shm, second)).st_mode & 0o777 == 0o700
    assert run_id.for_script(["--x", "1", "--save", save, "--reft-shm-dir", shm])[0] == second


def test_a_planted_job_id_link_is_not_followed(tmp_path, shm):
    save = tmp_path / "ckpt"
    save.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("mine\n")
    os.symlink(target, save / run_id.FILE)
    job, how = run_id.for_run(str(save), shm)
    assert job.startswith("run-")
    assert target.read_text() == "mine\n"  # replaced by rename, the link's target intact
    assert not os.path.islink(save / run_id.FILE)


@needs_setpriv
def test_a_squatted_job_parent_gets_a_fresh_id(tmp_path, shm):
    """The name of a job seen in a listing, made by another user once the job's memory
    is gone: the next launch takes another id instead of failing on it."""
    save = str(tmp_path / "ckpt")
    job, _ = run_id.for_run(save, shm)
    nobody("mkdir", "-m", "0777", paths.job_parent(shm, job), check=True)
    assert os.stat(paths.job_parent(shm, job)).st_uid == NOBODY  # the attack was made
    again, _ = run_id.for_run(save, shm)
    assert again != job
    ShmSegment.create(paths.domain(again, 0), "x", 8, base_dir=shm).close()


# ---- 60.4: a lost node's directory can no longer be squatted ----------------------------
@needs_setpriv
def test_wiped_node_directory_cannot_be_made_by_another_user(shm):
    job = run_id.fresh()
    for node in range(3):
        ShmSegment.create(paths.domain(job, node), "rank.slot0.bin", 4096, base_dir=shm).close()
    lost = paths.node_dir(shm, job, 2)
    shutil.rmtree(lost)  # the node and its memory are gone
    # the attacker knows the job id (a watcher's --job) and tries both names
    attempt = nobody("mkdir", "-m", "0777", lost)
    assert attempt.returncode != 0 and "Permission denied" in attempt.stderr, attempt
    assert not os.path.exists(lost)
    old_name = os.path.join(shm, f"reft-{job}-node2")
    nobody("mkdir", "-m", "0777", old_name, check=True)
    assert os.stat(old_name).st_uid == NOBODY  # made, and changes nothing
    seg = ShmSegment.create(paths.domain(job, 2), "rank.slot0.bin", 4096, base_dir=shm)
    assert seg.path.startswith(lost + "/") and os.stat(lost).st_uid == os.geteuid()
    seg.close()


def test_reft_status_lists_and_cleans_only_unused_job_memory(shm):
    idle, busy = run_id.fresh(), run_id.fresh()
    ShmSegment.create(paths.domain(idle, 0), "a", 1 << 16, base_dir=shm).close()
    held = ShmSegment.create(paths.domain(busy, 0), "a", 1 << 16, base_dir=shm)
    os.mkdir(os.path.join(shm, "reft-other-layout"), 0o700)
    open(os.path.join(shm, "reft-other-layout", "rank0.bin"), "w").close()
    try:
        tool = [sys.executable, os.path.join(REPO, "tools", "reft_status.py"),
                "--shm-dir", shm]
        env = dict(os.environ, **ENV_PATH)
        listed = subprocess.run(tool + ["--list-shm"], capture_output=True, text=True,
                                env=env, check=True).stdout
        assert f"reft-{idle}: " in listed and "no process uses it" in listed
        assert f"reft-{busy}: " in listed and f"in use by pid(s) [{os.getpid()}]" in listed
        assert "other-layout" not in listed
        cleaned = subprocess.run(tool + ["--clean"], capture_output=True, text=True,
                                 env=env, check=True).stdout
        assert f"removed {paths.job_parent(shm, idle)}" in cleaned
        assert "in use by pid(s)" in cleaned  # this test maps the busy one
        assert not os.path.exists(paths.job_parent(shm, idle))
        assert os.path.exists(paths.job_parent(shm, busy))
        assert [j["job"] for j in leftovers.jobs(shm)] == [busy]
    finally:
        held.close()


# ---- 60.5: Slurm's job id and store port ------------------------------------------------
def _slurm_setup(tmp_path, job_id: str) -> dict:
    script = (f"source {REPO}/examples/slurm/reft_job.sh; reft_job_setup >/dev/null; "
              "echo \"$REFT_JOB_ID $RDZV_PORT\"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RDZV", "REFT"))}
    env.update(PATH=f"{STANDIN}:{env['PATH']}", SLURM_JOB_ID=job_id,
               SLURM_JOB_NODELIST="127.0.1.10", REPO=REPO, PYTHON=sys.executable,
               SLURM_SUBMIT_DIR=str(tmp_path), NPROC_PER_NODE="1")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rid, port = out.stdout.split()
    return {"id": rid, "port": port}


@needs_setpriv
def test_slurm_job_names_and_port_are_not_predictable(tmp_path):
    job_id = str(424242 + os.getpid() % 1000)
    squat = f"/dev/shm/reft-{job_id}-node0"  # what the old naming would have used
    old_port = 29400 + int(job_id) % 1000
    holder = subprocess.Popen([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                               "--clear-groups", PY, "-c",
                               "import socket, sys, time; s = socket.socket(); "
                               f"s.bind(('127.0.1.10', {old_port})); s.listen(); "
                               "print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the port is really held
        nobody("mkdir", "-m", "0777", squat, check=True)
        nobody("mkdir", "-m", "0777", f"/dev/shm/reft-{job_id}", check=True)
        one, two = _slurm_setup(tmp_path, job_id), _slurm_setup(tmp_path, job_id)
        assert one["id"].startswith(f"{job_id}-") and len(one["id"]) == len(job_id) + 17
        assert one["id"] != two["id"]  # a secret part, new per job
        assert one["port"] == "0"  # bound by the store, not worked out from the job id
        ShmSegment.create(paths.domain(one["id"], 0), "x", 8).close()  # the job's own
        ShmSegment.remove_job(paths.domain(one["id"], 0))
        assert not os.path.exists(paths.job_parent("/dev/shm", one["id"]))
        # the store binds port 0 and passes the port on through its ready file
        ready = tmp_path / "ready"
        store = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "slurm",
                                                               "rdzv_store.py"),
                                  "--host", "127.0.1.10", "--port", "0", "--ready-file",
                                  str(ready)], env=dict(os.environ, **ENV_PATH),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while not (ready.exists() and len(ready.read_text().split()) == 2):
                assert store.poll() is None and time.time() < deadline
                time.sleep(0.1)
            port = int(ready.read_text().split()[-1])
            assert port not in (0, old_port)
            socket.create_connection(("127.0.1.10", port), timeout=10).close()
        finally:
            store.send_signal(signal.SIGTERM)
            store.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait()
        for d in (squat, f"/dev/shm/reft-{job_id}"):
            shutil.rmtree(d, ignore_errors=True)


# ---- 60.6: `make run`'s log -------------------------------------------------------------
RUN_LOG = [sys.executable, os.path.join(REPO, "tools", "run_log.py")]


@needs_setpriv
def test_run_dir_of_another_user_with_a_linked_log_is_refused():
    import pathlib
    import tempfile

    top = pathlib.Path(tempfile.mkdtemp(prefix="reft-runlog-", dir="/tmp"))
    try:
        _linked_log_attack(top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _linked_log_attack(top):
    shared = top / "shared"
    shared.mkdir()
    os.chmod(top, 0o755)
    os.chmod(shared, 0o1777)
    victim = top / "mine.txt"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    run_dir = shared / "run"
    nobody("mkdir", "-m", "0777", str(run_dir), check=True)
    nobody("ln", "-s", str(victim), str(run_dir / "train.log"), check=True)
    assert os.lstat(run_dir / "train.log").st_uid == NOBODY  # the attack was made
    made = subprocess.run(RUN_LOG + ["--mkdir", str(run_dir)], capture_output=True, text=True)
    assert made.returncode != 0 and f"belongs to uid {NOBODY}" in made.stderr
    tee = subprocess.run(RUN_LOG + [str(run_dir / "train.log")], input="overwritten\n",
                         capture_output=True, text=True)
    assert tee.returncode != 0 and "RUN_DIR" in tee.stderr
    assert victim.read_text() == "precious\n"


def test_own_run_dir_link_is_refused_and_log_survives_ctrl_c(tmp_path):
    run_dir = tmp_path / "run"
    assert subprocess.run(RUN_LOG + ["--mkdir", str(run_dir)]).returncode == 0
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, run_dir / "linked.log")
    out = subprocess.run(RUN_LOG + [str(run_dir / "linked.log")], input="x\n",
                         capture_output=True, text=True)
    assert out.returncode != 0 and "symbolic link" in out.stderr
    assert victim.read_text() == "keep\n"
    # Ctrl-C reaches the whole pipeline; the job's lines printed while it stops are kept
    log = run_dir / "train.log"
    job = ("trap 'echo flushed after SIGINT; exit 130' INT; echo training; "
           "while :; do sleep 0.05; done")
    pipe = subprocess.Popen(["bash", "-c", f"bash -c \"{job}\" | "
                             f"{' '.join(RUN_LOG)} {log}"], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while "training" not in (log.read_text() if log.exists() else ""):
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(pipe.pid, signal.SIGINT)
    pipe.communicate(timeout=30)
    assert log.read_text().splitlines() == ["training", "flushed after SIGINT"]
