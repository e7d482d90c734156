"""pytest fixtures shared by every test; the helpers they use are in tests/harness/."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import events as ev
from tests.harness.run import RunResult, torchrun


@pytest.fixture(scope="session")
def reference_runs():
    """Failure-free runs, computed once per session and shared by every test (in any
    file) that compares against the same command line. The cache is keyed by the command
    line itself, so two tests can never share a run of different flags; ``name`` only
    documents the call site."""
    cache: dict = {}

    def get(name: str, nproc: int, args: list[str]) -> RunResult:
        key = (nproc, tuple(args))
        if key not in cache:
            cache[key] = torchrun(nproc, args).check()
        return cache[key]

    return get


@pytest.fixture
def cpu_hog():
    """A busy host for the test's duration: two busy loops per CPU this process may use
    (the load of other jobs sharing the cores), killed afterwards. Yields their count.
    Each in a session of its own, as every torchrun agent and worker is: the kernel's
    autogroups share the CPUs out between sessions first, so loops in the test's own
    session would hardly slow a job at all."""
    n = 2 * len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(n)]
    try:
        yield n
    finally:
        for p in hogs:
            p.kill()
        for p in hogs:
            p.wait()


@pytest.fixture
def events(tmp_path, monkeypatch):
    """What this process records meanwhile (REFT_EVENTS_FILE): a function that reads it."""
    path = str(tmp_path / "events.jsonl")
    monkeypatch.setenv(ev.ENV, path)
    return lambda: ev.load(path)


@pytest.fixture
def shm_store():
    """A SnapshotStore of 2 slots for rank 0 of a fresh job in /dev/shm; afterwards
    closed, whatever it handed over released, and its segments removed."""
    import uuid

    from reft_ext.store import handover
    from reft_ext.store.shm import ShmSegment
    from reft_ext.store.slots import SnapshotStore

    job = "t" + uuid.uuid4().hex[:8]
    s = SnapshotStore(job, 0, 0, "/dev/shm", slots=2)
    yield s
    s.close()
    handover.release()
    ShmSegment.remove_job(s.job, base_dir="/dev/shm")
