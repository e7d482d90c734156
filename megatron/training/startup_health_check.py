"""The start-up health check's call site: what happens to this process when a node failed.
It runs before any state exists and may end the process, so it lives apart from the state
adapter and the session (reft_integration.py, which imports its names for the trainer).

Health check (reft_ext/cluster/health.py), run before any state is loaded; on a failed
node (docs/nodes.md):

* elastic (``--reft-min-nodes``, torchrun ``--nnodes MIN:MAX``) and the layout still
  valid without the node: the node's workers stop their own torchrun agent with SIGTERM
  and the healthy workers exit with EXIT_REGROUP; their agents restart them, the
  rendezvous completes without the node, and the job resumes with fewer data-parallel
  replicas (what host memory does then: reft_ext/cluster/shrink.py);
* otherwise every node's workers stop their agent: the job ends with one line that names
  the node and the flag.

Why SIGTERM to the agent: torch/distributed/launcher/api.py shuts the rendezvous down
(for every node) when an agent ends with failed workers, but not when it dies by a signal
(SignalException), so that the other agents can go on without it.
"""

from __future__ import annotations

import copy
import datetime
import os
import signal
import sys
import time

import torch

from megatron.training import inprocess_generation
from megatron.training.utils import emit
from reft_ext.cluster import shrink
from reft_ext.cluster.health import run_health_check
from reft_ext.cluster.health_config import HealthConfig
from reft_ext.config import ReftConfig
from reft_ext.report.events import emit as reft_emit, record
from reft_ext.testing import fault_specs
from reft_ext.testing import fault_point  # --inject-fault moments (no-op in production)


EXIT_REGROUP = 75    # EX_TEMPFAIL: healthy worker, restart me in the smaller job
EXIT_EXCLUDED = 76   # a worker of the failed node (its agent is stopping it anyway)
AGENT_WAIT_S = 30.0  # the agent SIGTERMs its workers within its monitor interval


def _say(msg: str, event: str | None = None, **fields) -> None:
    reft_emit(event, f"health: {msg}", **fields)


def _restarts_left() -> int | None:
    """torchrun restarts this agent still has (None outside torchrun)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) -
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _job_attempt(mine: int, timeout_s: int) -> int:
    """The highest attempt any rank sees: an agent restarted for a membership change
    (other agents already waiting in the rendezvous before its own workers failed) does
    not count a restart, so the agents of one job can disagree on the count."""
    return _job_max([mine], timeout_s)[0]


def _job_max(mine: list[int], timeout_s: int) -> list[int]:
    """Element-wise maximum of every rank's ``mine`` (gloo, the check's timeout)."""
    pg = torch.distributed.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.tensor(mine, dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=pg)
    torch.distributed.destroy_process_group(pg)
    return [int(x) for x in t.tolist()]


def shrink_plan(args, hc: HealthConfig, report, ranks_per_node: int) -> tuple[bool, str]:
    """(can the job go on without the failed nodes, why / what it becomes)."""
    bad, n = report.bad_nodes, len(report.nodes)
    left = n - len(bad)
    if report.unresolved:
        return False, "the check named no single node to leave out"
    if not hc.min_nodes:
        return False, (f"the launch is not elastic: start it with torchrun --nnodes MIN:{n} "
                       f"and --reft-min-nodes MIN (tools/launch_nodes.py --min-nodes MIN) "
                       f"to let it go on without node(s) {bad}")
    if left < hc.min_nodes:
        return False, (f"{left} node(s) would remain, fewer than --reft-min-nodes "
                       f"{hc.min_nodes}")
    healthy = [r for r in range(len(report.info)) if r // ranks_per_node not in bad]
    if any(report.info[r] is None for r in healthy):
        return False, "not started by torchrun: nothing would restart the healthy nodes"
    if any(report.info[r] < 1 for r in healthy):
        return False, ("torchrun has no restart left (--max-restarts) for the healthy nodes "
                       "to regroup")
    from megatron.training.arguments import ArgumentError, validate_args

    new = copy.copy(args)
    new.world_size, new.inject_fault = left * ranks_per_node, None
    try:
        validate_args(new)
    except ArgumentError as exc:
        return False, f"the layout cannot shrink to {new.world_size} ranks: {exc}"
    return True, (f"the job goes on with {left} of {n} nodes ({new.world_size} ranks, "
                  f"--reft-min-nodes {hc.min_nodes}): data-parallel size "
                  f"{args.data_parallel_size} -> {new.data_parallel_size}, global batch "
                  f"{args.global_batch_size} in {new.num_microbatches} micro-batches per "
                  f"rank; the healthy nodes restart and resume from the newest state "
                  f"that fits the new layout")


def resume_iteration(args, cfg: ReftConfig, rank: int) -> int:
    """The iteration this attempt will resume from as far as this rank can tell before
    the load: the newer of its committed REFT snapshot (its commit pointer in host
    memory) and the persistent tracker of --load; 0 for a fresh start. The ``health``
    fault phase's ITER is the maximum over the ranks (a rank whose node was lost has no
    pointer)."""
    from megatron.training.checkpointing import CheckpointError, read_tracker
    from reft_ext.store.paths import node_dir
    from reft_ext.store.slots import read_sealed

    its = [0]
    path = os.path.join(node_dir(cfg.shm_dir, cfg.job_id, cfg.node_of(rank)),
                        f"rank{rank}.committed")
    try:
        pointer, _ = read_sealed(path)
        its.append(int((pointer or {}).get("iteration", 0)))
    except (OSError, ValueError, TypeError):
        pass
    if args.load and os.path.isdir(args.load):
        try:
            its.append(read_tracker(args.load) or 0)
        except CheckpointError:
            pass
    return max(its)


def startup_health_check(args) -> bool:
    """Run the check if enabled; returns whether it ran. Does not return when a node
    failed (the process leaves the job or the job stops)."""
    hc = HealthConfig.from_args(args)
    if not hc.enabled(args.reft_snapshot_every):
        return False
    cfg = ReftConfig.from_args(args)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rpn, node = cfg.ranks_per_node, rank // cfg.ranks_per_node
    attempt, inject = fault_specs.attempt(), None
    # tests and demos only; every rank parses the same flags, so all or none of them
    # take part in the collective
    if any(f.phase == "health" for f in
           fault_specs.parse_fault_specs(args.inject_fault or "")):
        # --inject-fault ...@health: ITER is the iteration the job resumes from
        attempt, resume = _job_max([attempt, resume_iteration(args, cfg, rank)],
                                   hc.health_timeout)
        fault_point("health", iteration=resume, attempt=attempt)
    elif hc.injection:
        attempt = _job_attempt(attempt, hc.health_timeout)
    if hc.injection:
        inject = hc.injection[:2] if hc.injection[2] == attempt else None
    if inject and inject[0] == node and rank % rpn == 0:
        emit(f"[FAULT] node {node} (rank {rank}) made to fail the {inject[1]} health check "
             f"on attempt {attempt}")
    report = run_health_check(rank, world, rpn, matmul_size=hc.health_matmul_size,
                              timeout_s=hc.health_timeout, inject=inject,
                              info=_restarts_left(),
                              device="cuda" if torch.cuda.is_available() else "cpu",
                              rejoin=inprocess_generation.rejoining())
    record("health", ok=report.ok, nodes=report.nodes, unresolved=report.unresolved,
           failures=[{"node": f.node, "check": f.check, "reason": f.reason}
                     for f in report.failures])
    if report.ok:
        if rank == 0:
            for line in report.lines():
                _say(line)
        return True
    if node in report.bad_nodes and rank % rpn == 0:  # the node's own status (one writer)
        why = "; ".join(f"{f.check}: {f.reason}" for f in report.failures if f.node == node)
        shrink.mark_unhealthy(cfg, node, report.node_ranks[node], why)
    for line in report.lines():  # every rank: each node's log says what happened
        _say(line)
    go_on, why = shrink_plan(args, hc, report, rpn)
    bad = report.bad_nodes or report.nodes
    # the last barrier: gloo with the check's timeout (a broken node must not hold the
    # others for --distributed-timeout-minutes)
    pg = torch.distributed.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=hc.health_timeout))
    if not go_on:
        _say(f"error: node(s) {bad} failed the health check and the job cannot go on "
             f"without them: {why}. Stopping the job.", event="health_stop", nodes=bad,
             reason=why)
        _leave(EXIT_EXCLUDED, True, pg)
    _say(f"excluding node(s) {bad}: {why}", event="shrink", nodes=bad, reason=why)
    if node in bad:
        if rank % rpn == 0:
            shrink.leave_job(cfg, node)
        _leave(EXIT_EXCLUDED, True, pg)
    shrink.hand_over(cfg, rank, node, world)  # who this rank was, for the smaller job
    _leave(EXIT_REGROUP, False, pg)
    return True  # not reached


def _leave(code: int, stop_agent: bool, pg) -> None:
    """Exit this worker. ``stop_agent``: the node's first rank SIGTERMs its torchrun agent
    and every rank of the node waits for the agent's SIGTERM back, so no agent can rejoin
    the rendezvous before the healthy workers exit (a barrier over the whole job)."""
    got = []
    if stop_agent and "TORCHELASTIC_RUN_ID" in os.environ:
        signal.signal(signal.SIGTERM, lambda *_: got.append(1))
        agent = os.getppid()  # torchrun's agent Popens its workers itself
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and _is_torchrun(agent):
            _say(f"rank {torch.distributed.get_rank()}: stopping this node's torchrun agent "
                 f"(pid {agent})")
            os.kill(agent, signal.SIGTERM)
        deadline = time.time() + AGENT_WAIT_S
        while not got and time.time() < deadline:
            time.sleep(0.02)
    try:  # everyone stopping an agent has seen it stop before anyone exits
        torch.distributed.barrier(group=pg)
    except RuntimeError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    if "TORCHELASTIC_RUN_ID" not in os.environ and code == EXIT_EXCLUDED:
        raise SystemExit(code)
    os._exit(code)


def _is_torchrun(pid: int) -> bool:
    """Only ever signal a torchrun agent (never a shell or a test harness)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        return b"torch.distributed.run" in cmd or b"torchrun" in cmd
    except OSError:
        return False
