"""The pieces of the in-process restart, each with real torch.distributed (gloo):
aborting a blocked collective, rebinding megatron-core's process groups, the flags."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from reft_ext.config import ReftConfig, ReftConfigError
from tests.harness.run import ENV_PATH, REPO

from tools.launch_nodes import LaunchConfig, LaunchError

# rank 1 waits in an all_reduce for rank 0, which never comes; rank 1's own thread then
# shuts its peer connections down (what its abort watcher does) and the wait must end
# with a gloo error that is_failure() recognizes. Nothing else can end it: rank 0 stays
# alive (until the test kills it) and gloo's timeout is 10 minutes, far beyond the test's
# wait
_BLOCKED = textwrap.dedent("""
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from reft_ext.cluster import inprocess
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    if rank == 0:
        time.sleep(3600)  # alive and silent until the test kills it
        sys.exit(0)
    lock = threading.Lock()

    def say(line):  # one write per line, under a lock: the two threads' lines never mix
        with lock:
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()

    threading.Timer(1.0, lambda: say(f"closed {inprocess.shutdown_peer_sockets({port})}")
                    ).start()
    try:
        dist.all_reduce(torch.ones(4))
        say("no error")
    except RuntimeError as exc:
        say(f"woke failure={inprocess.is_peer_error(exc)}")
    time.sleep(0.5)  # the timer's line, if it is still being written
    os._exit(0)
""")


def test_shutting_the_connections_wakes_a_blocked_collective(tmp_path):
    from tools.launch_nodes import free_port

    port = free_port()
    script = tmp_path / "blocked.py"
    script.write_text(_BLOCKED)
    env = dict(os.environ, **ENV_PATH, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (0, 1)]
    try:
        out = procs[1].communicate(timeout=300)[0]  # a bound on the wait only
        peer_alive = procs[0].poll() is None  # so its exit did not end the wait
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert peer_alive, out
    assert "closed " in out and int(out.split("closed ")[1].split()[0]) >= 1, out
    assert "woke failure=True" in out.splitlines(), out


_REBIND = textwrap.dedent("""
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0",
                      WORLD_SIZE="1")
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import inprocess, inprocess_generation

    def init():
        torch.distributed.init_process_group("gloo")
        mpu.initialize_model_parallel()
        inprocess_generation.after_initialize()

    class Holder:
        pass

    init()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "dp"])
    vars(pgs)  # a materialized attribute dict holding only groups: untracked by the gc
    h = Holder()
    h.groups = [mpu.get_data_parallel_group()]
    h.by_name = {"tp": mpu.get_tensor_model_parallel_group()}
    h.fn = (lambda g=None: lambda: g)(mpu.get_pipeline_model_parallel_group())
    roots = [pgs, h]
    old = inprocess.teardown()
    init()
    n = inprocess.rebind(old, inprocess.base_groups(), roots)
    assert pgs.tp is mpu.get_tensor_model_parallel_group()
    assert pgs.pp is mpu.get_pipeline_model_parallel_group()
    assert pgs.dp is mpu.get_data_parallel_group()
    assert h.groups[0] is mpu.get_data_parallel_group()
    assert h.by_name["tp"] is mpu.get_tensor_model_parallel_group()
    assert h.fn() is mpu.get_pipeline_model_parallel_group()
    inprocess.check_released(roots)
    # a group held in a tuple cannot be replaced: the restart must say so
    h.frozen = (mpu.get_data_parallel_group(),)
    old = inprocess.teardown()
    init()
    try:
        inprocess.rebind(old, inprocess.base_groups(), roots)
        print("no error")
    except inprocess.RestartError as exc:
        print("refused:", exc)
    print("rebound", n)
""")


def test_rebind_points_every_holder_at_the_new_groups(tmp_path):
    from tools.launch_nodes import free_port

    script = tmp_path / "rebind.py"
    script.write_text(_REBIND)
    env = dict(os.environ, **ENV_PATH, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(script), str(free_port())], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused: old process groups held where they cannot be replaced: ['tuple']" \
        in out.stdout, out.stdout
    assert int(out.stdout.split("rebound ")[1].split()[0]) >= 6


def test_restart_flags_are_checked():
    with pytest.raises(ReftConfigError, match="--reft-restart"):
        ReftConfig(restart="sometimes")
    assert ReftConfig().restart == "in-process"
    with pytest.raises(LaunchError, match="--spares"):
        LaunchConfig(spares=1)
    with pytest.raises(LaunchError, match="--restart"):
        LaunchConfig(restart="maybe")
