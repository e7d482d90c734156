"""Issue 60, finding 4, end to end: a lost node's wiped /dev/shm directory squatted by
another user (nobody, via setpriv) no longer stops the recovery. Real torchrun agents
(tools/launch_nodes.py), a real SIGSTOP and node loss, the attacker's mkdir really made."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.harness.nodes import finish, launcher, stop_then_lose
from tests.harness.recovery import N, OWN, reft
from tests.harness.run import LAYOUTS, TINY
from tests.unit.test_job_places import nobody
from tests.unit.test_safe_paths import NOBODY, needs_setpriv
from reft_ext.store import paths


@needs_setpriv
@pytest.mark.slow  # ~40 s; the squat itself is in the default tier (test_job_places.py)
def test_squatted_wiped_node_directory_does_not_stop_recovery(tmp_path):
    with launcher(2, 1, TINY + N + LAYOUTS["dp4"] + reft("arc", None) +
                  ["--inject-fault", "1:4:STOP"], tmp_path) as L:
        L.start()
        lost = paths.node_dir(L.cfg.shm_dir, L.job_id, 1)
        old_name = os.path.join(L.cfg.shm_dir, f"reft-{L.job_id}-node1")
        try:
            L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 1 ", timeout=120)
            L.kill_node(1)  # node 1 and its memory are gone
            assert not os.path.exists(lost)
            # the attacker read the job id (a watcher's --job) and makes the node's names
            attempt = nobody("mkdir", "-m", "0777", lost)
            assert attempt.returncode != 0 and "Permission denied" in attempt.stderr
            nobody("mkdir", "-m", "0777", old_name, check=True)
            assert os.stat(old_name).st_uid == NOBODY  # the attack was made
            L.replace_node(1)
            run = finish(L).check()
        finally:
            shutil.rmtree(old_name, ignore_errors=True)
    assert "belongs to uid" not in run.output
    assert run.events_of("recovered", iteration=3, rank=1, source="replica"), \
        run.output[-3000:]
    assert run.events_of("recovered", iteration=3, rank=0, source=OWN)
