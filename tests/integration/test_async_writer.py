"""What a rank forks dies with it (megatron/training/children.py). Found by
tools/chaos.py: a rank SIGKILLed while megatron-core's forked checkpoint writer was still
writing left that writer behind, orphaned, writing a checkpoint nobody would finalize,
holding the job's stdout (so torchrun waited on it) and the rank's deleted shared
memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.harness.run import ENV_PATH

TRAINER = r"""
import multiprocessing as mp, os, sys, time
from megatron.training import children
children.install()  # as the trainer does first

def write(pid_file):  # a checkpoint write that takes long
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(120)

# as megatron-core's TemporalAsyncCaller starts the writer: a fork from the main thread
mp.get_context("fork").Process(target=write, args=(sys.argv[1],)).start()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(ln for ln in f if ln.startswith("State:"))
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]  # a zombie has ended


def test_a_forked_writer_dies_when_its_rank_is_killed(tmp_path):
    pid_file = str(tmp_path / "writer.pid")
    env = dict(os.environ, **ENV_PATH)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, pid_file], env=env)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(pid_file):
            assert trainer.poll() is None, trainer.returncode
            assert time.monotonic() < deadline, "the writer never started"
            time.sleep(0.1)
        writer = int(open(pid_file).read())
        assert writer != trainer.pid and _alive(writer)
        trainer.send_signal(signal.SIGKILL)  # the fault: the rank dies mid-write
        trainer.wait()
        deadline = time.monotonic() + 10
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(writer), f"writer {writer} outlived its killed trainer"
    finally:
        trainer.kill()
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), signal.SIGKILL)
            except ProcessLookupError:
                pass
