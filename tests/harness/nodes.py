"""Test harness: a job of N torchrun agents ("nodes") on this host, built on
tools/launch_nodes.py, and the node-level faults the tests script against it.

A precise, deterministic node loss: ``--inject-fault R:ITER:STOP`` freezes rank R right
before the optimizer step of ITER (so the snapshot of ITER-1 is committed everywhere and
nothing of ITER is); its agent sees nothing (a stopped process is alive), the other ranks
wait in their next collective; the test sees the ``[FAULT]`` line and kills the whole node
(agent, workers, memory). The survivors' workers then fail, their agents re-rendezvous,
and the replacement agent completes the round.

Every node's processes (workers and watchers) append their REFT events to one file per
launcher (tests/harness/events.py): ``events(L)`` reads it, ``finish`` returns it with
the run.
"""

from __future__ import annotations

import tempfile
import time

from tests.harness import events as ev
from tests.harness.oracle import with_final_checkpoint
from tests.harness.run import RunResult, events_file, parse

from tools.launch_nodes import LaunchConfig, NodeLauncher


def launcher(nnodes: int, nproc: int, args: list[str], tmp_path, **cfg) -> NodeLauncher:
    cfg.setdefault("max_restarts", 2)
    args, ckpt = with_final_checkpoint(args)
    L = NodeLauncher(LaunchConfig(nnodes=nnodes, nproc_per_node=nproc,
                                  log_dir=tempfile.mkdtemp(dir=tmp_path, prefix="logs-"),
                                  **cfg), args,
                     env={ev.ENV: events_file(str(tmp_path))})
    L.final_checkpoint = ckpt  # where the run's final checkpoint goes (finish: .checkpoint)
    return L


def events(L: NodeLauncher) -> ev.Events:
    """What the job's processes recorded so far (every node, every attempt)."""
    return ev.load(L.env[ev.ENV])


def stop_then_lose(L: NodeLauncher, rank: int, nodes: list[int], timeout: float = 90) -> None:
    """Wait until ``rank`` froze itself (its [FAULT] line), then lose ``nodes`` at once
    and start their replacements (empty memory)."""
    L.wait_for(rf"\[FAULT\] injecting SIGSTOP into rank {rank} ", timeout=timeout)
    for n in nodes:
        L.kill_node(n)
    for n in nodes:
        L.replace_node(n)


def finish(L: NodeLauncher, timeout: float = 150) -> RunResult:
    """Wait for the job; parse every node's output ([HASH] of each rank, [LOSSES] of the
    last rank's final attempt) and its events as one run. Return code: the worst agent's."""
    codes = L.wait(timeout)
    out = L.outputs()
    res = parse(out, max(abs(c) for c in codes.values()), L.env[ev.ENV])
    res.checkpoint = getattr(L, "final_checkpoint", None)
    return res


def wait_for_event(L: NodeLauncher, event: str, timeout: float = 120, **match) -> dict:
    """Block until some process of the job recorded ``event`` (with ``match``); returns it.
    The job's agents must still be running (a job that ended first fails the wait)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = events(L).of(event, **match)
        if found:
            return found[0]
        if all(p.poll() is not None for p in L.procs.values()):
            break
        time.sleep(0.05)
    raise AssertionError(f"no {event} event {match} within {timeout} s:\n"
                         f"{L.outputs()[-4000:]}")
