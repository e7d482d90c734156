"""Megatron's side of REFT, and nothing else: the state adapter, building the session
(reft_ext/session.py) from the flags, the schedule events, and the start-up health
check's call site. What REFT does lives in reft_ext; the training loop calls only
:func:`pipeline_events`, :func:`open_session`, :func:`startup_health_check` and the
session's methods.

This module holds what REFT sees of a training state (the process groups its host
tensors travel on, the loss verdict's groups, :class:`MegatronStateAdapter`) and the
session built from them. The start-up health check runs before any state exists and
decides whether this process stays in the job at all, so it is a module of its own
(startup_health_check.py); its names are imported here, where the trainer takes them.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from megatron.training import optimizer_state
from megatron.training.startup_health_check import (  # noqa: F401 - re-exported
    AGENT_WAIT_S,
    EXIT_EXCLUDED,
    EXIT_REGROUP,
    resume_iteration,
    shrink_plan,
    startup_health_check,
)
from megatron.training.train_state import TrainingState
from reft_ext.cluster import groups
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.load.rollback import RollbackConfig
from reft_ext.report.events import reft_print
from reft_ext.session import DisabledSession, ReftSession, SnapshotsUnavailable
from reft_ext.testing import fault_observer, fault_specs


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
        # megatron-core reduces the distributed optimizer's grad norm over the whole job:
        # the NaN verdict needs no collective of its own (reft_ext/session.py)
        self.grad_norm_job_wide = bool(args.use_distributed_optimizer)
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


def bare_shards_line(protect: str) -> str:
    """ZeRO-1 without AOR: each optimizer shard lives on one rank only, whatever the
    scheme does for the parameters; said once at start, with its cost and its cure."""
    redundancy = protect.split(",")[0]
    cure = "aec,aor" if redundancy == "aec" else "arc,aor"
    return (f"ZeRO-1 optimizer shards unprotected: --reft-protect {protect} keeps no copy of "
            f"a rank's optimizer shard (--use-distributed-optimizer) on another node, so a "
            f"lost node costs the persistent checkpoint (--load; from scratch without one); "
            f"a crash still restores from host memory. --reft-protect {cure} covers them "
            f"(a host replica of each shard on another node: docs/aor.md)")


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
    try:
        session = ReftSession(cfg, adapter, state, events=events, trace_group=trace_group,
                              rollback=RollbackConfig.from_args(args),
                              fused_load=not args.no_load_optim)
    except SnapshotsUnavailable as exc:  # a restart into a full /dev/shm: go on without
        if adapter.rank == 0:
            reft_print(f"snapshots off for this attempt: {exc} (at a restart: the job goes "
                       f"on from its persistent checkpoint, --save/--load; free the space, "
                       f"or see docs/security.md, to have them again at the next start)",
                       event="snapshots_off", reason="shm-full")
        return DisabledSession(cfg.trace_file, events, trace_group)
    if adapter.rank == 0 and args.use_distributed_optimizer and not cfg.aor:
        reft_print(bare_shards_line(cfg.protect), event="owned_unprotected",
                   protect=cfg.protect)
    obs = fault_observer.observer() or fault_observer.install(faults, adapter.rank)
    if obs is not None:  # tests and demos: the REFT part of this rank's --inject-fault modes
        from reft_ext.testing.faults import ReftFaults

        obs.reft = ReftFaults(session)
    return session
