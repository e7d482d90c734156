"""A restart into a /dev/shm that another user filled goes on without snapshots (issue 60,
item 7).

Attempt 0 trains with snapshots in a small tmpfs of its own (--reft-shm-dir, mode 1777 as
/dev/shm); rank 1's failure domain is lost at iteration 3 (its shared memory wiped). uid
1002 (``setpriv``) takes every page the wipe freed, so attempt 1 cannot make rank 1's
segments again. Before, every restart failed the same way; now every rank turns snapshots
off (one ``[REFT]`` line) and the job goes on from its persistent checkpoint of
iteration 2, ending bit-identical to the failure-free run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import N, reft
from tests.harness.run import TINY, torchrun
from tests.integration.test_rendezvous_security import OTHER_UID, SETPRIV, as_other_user

BASE = TINY + N + ["--global-batch-size", "8"]

# uid OTHER_UID: once the job's memory has grown and then shrunk by a quarter (the wipe),
# take every free page of the filesystem, and keep taking what is freed, until told
FILL = r"""
import os, sys, time
mnt, stop = sys.argv[1:3]
def used():
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
peak, deadline = 0, time.time() + 600
while time.time() < deadline and not os.path.exists(stop):
    peak = max(peak, used())
    if peak and used() < 0.75 * peak:
        break
    time.sleep(0.02)
fd = os.open(os.path.join(mnt, "mine"), os.O_RDWR | os.O_CREAT, 0o600)
size, said = 0, False
while time.time() < deadline and not os.path.exists(stop):
    for chunk in (1 << 20, 1 << 12):
        while True:
            try:
                os.posix_fallocate(fd, size, chunk)
                size += chunk
            except OSError:
                break
    if not said:
        print("filled", size, "bytes as uid", os.getuid(), flush=True)
        said = True
    time.sleep(0.02)
"""


@pytest.fixture
def small_tmpfs():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="reft-shm-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=1777", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", mnt])
    shutil.rmtree(mnt, ignore_errors=True)


@pytest.mark.slow
@as_other_user
def test_a_restart_into_a_full_shm_goes_on_from_the_checkpoint(small_tmpfs, tmp_path,
                                                               reference_runs):
    ref = reference_runs("dp2", 2, BASE)
    save, stop = str(tmp_path / "ckpt"), os.path.join(small_tmpfs, "stop")
    filler = subprocess.Popen([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                               "--clear-groups", sys.executable, "-c", FILL, small_tmpfs,
                               stop], stdout=subprocess.PIPE, text=True, cwd="/",
                              env=dict(os.environ, PYTHONPATH=""))
    try:
        run = torchrun(2, BASE + reft("arc") + [
            "--reft-shm-dir", small_tmpfs, "--reft-flush-dir", "none",
            "--save", save, "--load", save, "--save-interval", "2",
            "--inject-fault", "1:3:KILL:node"], max_restarts=1)
    finally:
        filler.kill()  # (its stop file: a later run of the loop)
        out, _ = filler.communicate(timeout=60)
    assert f"as uid {OTHER_UID}" in out, out  # the other user did fill it
    run.check()
    assert "[FAULT] wiped failure domain" in run.output, run.output[-3000:]
    lines = [ln for ln in run.output.splitlines() if "snapshots off for this attempt" in ln]
    assert len(lines) == 1 and lines[0].startswith("[REFT] ") and "needs" in lines[0], \
        run.output[-4000:]
    assert run.events_of("snapshots_off", reason="shm-full"), run.events.names()
    assert "Bus error" not in run.output
    same_as_reference(run, ref, 3)
