"""Megatron's side of REFT, and nothing else: the state adapter, building the session
(reft_ext/session.py) from the flags, the schedule events, and the start-up health
check's call site. What REFT does lives in reft_ext; the training loop calls only
:func:`pipeline_events`, :func:`open_session`, :func:`startup_health_check` and the
session's methods.

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
from megatron.core import parallel_state as mpu

from megatron.training import inprocess_generation, optimizer_state
from megatron.training.train_state import TrainingState
from megatron.training.utils import emit
from reft_ext.cluster import groups, shrink
from reft_ext.cluster.health import run_health_check
from reft_ext.cluster.health_config import HealthConfig
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.load.rollback import RollbackConfig
from reft_ext.report.events import emit as reft_emit, record
from reft_ext.session import DisabledSession, ReftSession
from reft_ext.testing import fault_observer, fault_specs
from reft_ext.testing import fault_point  # --inject-fault moments (no-op in production)


# ---- the state adapter -------------------------------------------------------------
def _all_dp_groups() -> list[list[int]]:
    """Every sharding group of the job (each rank knows the whole layout)."""
    return _all_groups_like(mpu.get_data_parallel_group())


def _all_groups_like(group) -> list[list[int]]:
    """The ranks of every group of the job of the kind of ``group`` (one collective at
    start-up: each rank tells its own)."""
    world = torch.distributed.get_world_size()
    mine = torch.distributed.get_process_group_ranks(group)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, sorted(mine))
    groups = []
    for g in gathered:
        if g not in groups:
            groups.append(g)
    return groups


def host_group_refusal(backend: str) -> str | None:
    """Why a process group of ``backend`` (as ``dist.get_backend`` names it: "gloo",
    "nccl", "cpu:gloo,cuda:nccl") cannot carry host (CPU) tensors, or None when it can:
    REFT's collectives move CPU tensors, which only a gloo backend for the CPU carries
    (NCCL takes CUDA tensors only)."""
    text = str(backend).lower().replace(" ", "")
    if ":" in text:  # per device: the CPU's entry decides
        cpu = dict(p.split(":", 1) for p in text.split(",") if ":" in p).get("cpu")
    else:
        cpu = text
    if cpu in ("gloo", groups.BACKEND):  # reft_gloo: gloo kept across restarts
        return None
    return (f"its backend {backend!r} has {'no CPU backend' if cpu is None else cpu!r} "
            f"for host tensors (gloo needed)")


def host_dp_group(all_dp_groups: list[list[int]]):
    """The data-parallel group REFT's host tensors travel on: megatron-core's gloo DP
    group, made here when megatron-core made none (``create_gloo_process_groups=False``;
    collective: every rank creates every DP group, in the same order); refused by name,
    before training, when it cannot carry CPU tensors. Never the NCCL DP group."""
    try:
        group = mpu.get_data_parallel_group_gloo()
    except AssertionError:  # megatron-core asserts where it made no gloo groups
        group = None
    if group is None:
        rank = torch.distributed.get_rank()
        for ranks in all_dp_groups:
            pg = torch.distributed.new_group(ranks=ranks, backend="gloo")
            if rank in ranks:
                group = pg
    why = host_group_refusal(torch.distributed.get_backend(group))
    if why is not None:
        raise ReftConfigError(f"REFT's data-parallel group for host tensors cannot carry "
                              f"CPU tensors: {why}; initialize megatron-core's model "
                              f"parallel state with create_gloo_process_groups=True")
    return group


def verdict_groups(args, dp_group) -> list:
    """The loss-spike/NaN verdict's groups (reft_ext/session.py ``_job_wide``), the
    smallest that make it the same on every rank: the loss is known on the last pipeline
    stage only (the same on all of them: averaged over data parallel) -> the pipeline
    group (a gloo twin: host tensors). The grad norm is the same everywhere where
    megatron-core reduces it over the whole job (the distributed optimizer's one
    instance); without it, it is reduced over the model-parallel group only, and a NaN
    that enters one replica after the gradient all-reduce reaches only that replica ->
    the data-parallel group as well. Collective where megatron-core's pipeline groups
    are NCCL: every rank makes every gloo twin."""
    groups = []
    pp = mpu.get_pipeline_model_parallel_group()
    if args.pipeline_model_parallel_size > 1 and \
            host_group_refusal(torch.distributed.get_backend(pp)) is None:
        groups.append(pp)  # megatron-core's own carries host tensors (gloo): no twin
    elif args.pipeline_model_parallel_size > 1:  # NCCL: a gloo twin of every one
        rank = torch.distributed.get_rank()
        for ranks in _all_groups_like(pp):
            pg = torch.distributed.new_group(ranks=ranks, backend="gloo")
            if rank in ranks:
                groups.append(pg)
    world_norm = args.use_distributed_optimizer and \
        getattr(args, "num_distributed_optimizer_instances", 1) == 1
    if not world_norm and torch.distributed.get_world_size(dp_group) > 1:
        groups.append(dp_group)
    return groups


class MegatronStateAdapter:
    """REFT's view of a TrainingState (reft_ext.session.SessionAdapter): which tensors
    are replicated across the sharding group (model params, and the optimizer state
    unless it is distributed) and which are owned (ZeRO-1 shards), plus the small
    metadata."""

    def __init__(self, state: TrainingState, args):
        self.state, self.args = state, args
        self.ranks_per_node = ReftConfig.from_args(args).ranks_per_node  # (identity)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.global_batch_size = args.global_batch_size
        self.all_dp_groups = _all_dp_groups()
        self.dp_group = host_dp_group(self.all_dp_groups)  # gloo, checked (host tensors)
        self.dp_ranks = sorted(torch.distributed.get_process_group_ranks(self.dp_group))
        self.control_group = torch.distributed.new_group(backend="gloo")
        self.verdict_groups = verdict_groups(args, self.dp_group)
        # what the HAS scheduler's 1F1B formula needs: (pp, vpp, micro-batches)
        self.pipeline = (args.pipeline_model_parallel_size,
                         args.virtual_pipeline_model_parallel_size or 1, args.num_microbatches)

    def _split(self):
        rep, own = [], []
        for name, t in self.state.state_tensors():
            if name.startswith("optim.") and self.args.use_distributed_optimizer:
                own.append((name, t))
            else:
                rep.append((name, t))
        return rep, own

    def replicated_tensors(self):
        return self._split()[0]

    def owned_tensors(self):
        return self._split()[1]

    def torch_optimizers(self) -> list:
        """The torch optimizers inside megatron's (chained) distributed optimizer."""
        opt = self.state.optimizer
        return [c.optimizer for c in getattr(opt, "chained_optimizers", [opt])]

    def identity(self) -> dict:
        """What makes a state this run's (reft_ext/state/identity.py): not the DP size,
        which an elastic shrink changes."""
        from megatron.training.checkpointing import run_identity

        out = run_identity(self.args)  # + what makes host memory's layout this run's
        out["reft_protect"] = getattr(self.args, "reft_protect", None)
        out["reft_ranks_per_node"] = self.ranks_per_node
        return out

    def run_id(self) -> str | None:
        return self.state.extra.get("run_id")

    def get_meta(self) -> dict:
        return self.state.metadata()

    def set_meta(self, meta: dict) -> None:
        self.state.load_metadata(meta)


# ---- building the session ----------------------------------------------------------
def pipeline_events(args, transformer_config):
    """(events, forward-backward kwargs, trace group): the schedule's events (bubbles
    for HAS, the Chrome trace), only when REFT or its trace asks for them, so a plain
    run calls megatron-core exactly as Megatron-LM does."""
    cfg = ReftConfig.from_args(args)
    if not (cfg.enabled or cfg.trace_file):
        if any(fault_observer.wants(p) for p in fault_specs.SEAM_PHASES):
            # --inject-fault ...@forward|backward|send|recv on this rank: the timers seam
            # only (no events, megatron-core's own p2p communicator)
            from megatron.training import pipeline_events as events_mod

            events_mod.install(transformer_config, None)
        return None, {}, None
    from megatron.training import pipeline_events as events_mod
    from reft_ext.report.timeline import PipelineEvents

    events = PipelineEvents(torch.distributed.get_rank(), trace=bool(cfg.trace_file))
    if cfg.trace_file:
        events.trace.labels["process"] = (
            f"rank {events.trace.rank} (tp {mpu.get_tensor_model_parallel_rank()}, "
            f"pp {mpu.get_pipeline_model_parallel_rank()}, "
            f"dp {mpu.get_data_parallel_rank()})")
    fb_kwargs = events_mod.install(transformer_config, events)
    return events, fb_kwargs, trace_group(args)


def trace_group(args):
    """The gloo group the trace is gathered over (made again after an in-process
    restart, in the same place of the start-up order)."""
    cfg = ReftConfig.from_args(args)
    return torch.distributed.new_group(backend="gloo") if (cfg.enabled or cfg.trace_file) \
        else None


def open_session(args, state: TrainingState, faults=(), events=None, trace_group=None):
    """REFT's session for this rank (reft_ext/session.py): a DisabledSession when
    snapshots are off. ``faults``: the parsed ``--inject-fault`` specs; on a rank named
    there the fault observer (installed by the trainer, or here) gets REFT's damage
    (reft_ext/testing/faults.py)."""
    cfg = ReftConfig.from_args(args)
    if not cfg.enabled:
        return DisabledSession(cfg.trace_file, events, trace_group)
    # a fresh optimizer has no state yet: create all of it (per optimizer kind, unknown
    # kinds refused by name) so the layout is final, and after the first step check that
    # no state appeared the layout does not hold (optimizer_state.py)
    optimizer_state.ensure_state(state.optimizer)
    optimizer_state.FirstStepCheck(state.optimizer, [t for _, t in state.state_tensors()])
    adapter = MegatronStateAdapter(state, args)
    session = ReftSession(cfg, adapter, state, events=events, trace_group=trace_group,
                          rollback=RollbackConfig.from_args(args),
                          fused_load=not args.no_load_optim)
    obs = fault_observer.observer() or fault_observer.install(faults, adapter.rank)
    if obs is not None:  # tests and demos: the REFT part of this rank's --inject-fault modes
        from reft_ext.testing.faults import ReftFaults

        obs.reft = ReftFaults(session)
    return session


# ---- the start-up health check -------------------------------------------------------
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
