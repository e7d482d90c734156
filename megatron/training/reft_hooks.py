"""Thin call sites between the trainer and reft_ext: the state adapter, the snapshot hook
and REFT-load at start-up."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time

import torch
from megatron.core import parallel_state as mpu

from megatron.training import fault_injection, optimizer_state
from megatron.training.train_state import TrainingState
from megatron.training.utils import emit
from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.state.identity import refuse_other_runs
from reft_ext.cluster import status as node_status
from reft_ext.report import summary
from reft_ext.load.rollback import RollbackConfig, RollbackError, SpikeDetector
from reft_ext.load.recover import recover
from reft_ext.store.shm import ShmDirError, ensure_private_dir, job_dir
from reft_ext.save.snapshotter import ReftSnapshotter, reft_print
from reft_ext.store.slots import from_jsonable, to_jsonable


def _all_dp_groups() -> list[list[int]]:
    """Every sharding group of the job (each rank knows the whole layout)."""
    world = torch.distributed.get_world_size()
    mine = torch.distributed.get_process_group_ranks(mpu.get_data_parallel_group())
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, sorted(mine))
    groups = []
    for g in gathered:
        if g not in groups:
            groups.append(g)
    return groups


class MegatronStateAdapter:
    """REFT's view of a TrainingState: which tensors are replicated across the sharding
    group (model params, and the optimizer state unless it is distributed) and which
    are owned (ZeRO-1 shards), plus the small metadata."""

    def __init__(self, state: TrainingState, args):
        self.state, self.args = state, args
        self.ranks_per_node = ReftConfig.from_args(args).ranks_per_node  # (identity)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.dp_group = mpu.get_data_parallel_group_gloo() or mpu.get_data_parallel_group()
        self.dp_ranks = sorted(torch.distributed.get_process_group_ranks(self.dp_group))
        self.all_dp_groups = _all_dp_groups()
        self.control_group = torch.distributed.new_group(backend="gloo")
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
        """What makes a state this run's (reft_ext/state/identity.py): not the DP size, which an
        elastic shrink changes."""
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


class ReftHook:
    """after_step: snapshot; at start-up: recover; on exit: clean up shared memory."""

    def __init__(self, args, state: TrainingState, faults=(), events=None):
        self.cfg = ReftConfig.from_args(args)
        # a fresh optimizer has no Adam state yet: create it so the layout is final
        optimizer_state.ensure_adam_state(state.optimizer)
        self.adapter = MegatronStateAdapter(state, args)
        self._check_shm_dir()
        self.snap = ReftSnapshotter(self.cfg, self.adapter, events)
        self.faults = [f for f in faults if f.rank == self.adapter.rank]
        if any(f.mode == "snapshot" for f in self.faults):
            self.snap.fault = self._fault_in_snapshot
        fault_injection.NODE_LOSS_CALLBACKS.append(self.wipe_node)
        fault_injection.CORRUPT_CALLBACKS.append(self.corrupt)
        self.heartbeat = None  # --reft-hang-timeout (reft_ext/cluster/heartbeat.py), from on_start
        self.state = state
        self.args = args
        self.rollback_cfg = RollbackConfig.from_args(args)
        self.detector = SpikeDetector(self.rollback_cfg)
        self._t_step: float | None = None
        self.iteration_s: list[float] = []  # this process's iteration times (summary)

    def _check_shm_dir(self) -> None:
        """Before any segment exists: each rank's failure-domain directory must be this
        user's own (another user's, e.g. another job under the same --reft-job-id, is
        never written into). Job-wide, so every rank stops with the same one line
        instead of the others hanging in their next collective."""
        a = self.adapter
        d = job_dir(f"{self.cfg.job_id}-node{self.cfg.node_of(a.rank)}", self.cfg.shm_dir)
        try:
            ensure_private_dir(d)
            why = None
        except ShmDirError as exc:
            why = str(exc)
        seen = [None] * a.world_size
        torch.distributed.all_gather_object(seen, why, group=a.control_group)
        why = next((w for w in seen if w), None)
        if why:
            raise ShmDirError(errno.EACCES, why)

    def recover(self, persistent_iteration):
        # another run's snapshots (same --reft-job-id, other seed/model/data...): refuse
        # job-wide before anything is read or imported
        why = refuse_other_runs(self.snap.store, self.cfg.flush_dir, self.adapter.identity(),
                                self.adapter.control_group)
        if why:
            raise ReftConfigError(why)
        if self.cfg.flush_dir:  # save-on-failure tier: back into memory when newer
            from reft_ext.load.flushed import import_flushed

            flushed = import_flushed(self.snap.store, self.cfg.flush_dir, self.snap.nbytes)
            if flushed is not None:
                reft_print(f"rank {self.adapter.rank}: host memory had nothing newer than "
                           f"the flushed snapshot of iteration {flushed} in {self.cfg.flush_dir}: "
                           f"loaded it into host memory")
        from reft_ext.load.reshard import reshard_from_memory

        # after an elastic shrink (docs/nodes.md): the old job's snapshots, resharded
        it = reshard_from_memory(self.snap, persistent_iteration)
        if it is not None:
            self.count_recovery("memory, resharded after a shrink")
            return it
        # a fused restore that fails a checksum leaves bytes in the model that only a
        # full persistent load replaces (reft_ext/load/recover.py recover)
        it = recover(self.snap, persistent_iteration, fuse=not self.args.no_load_optim)
        if it is not None:
            self.count_recovery(self.snap.recovered_from or "host memory")
        return it

    def count_recovery(self, tier: str) -> None:
        """One recovery of the job, by the tier that served it (kept in the state)."""
        summary.count_recovery(self.state.extra, tier)

    def on_start(self, state):
        self.snap.start()  # AOR: every holder gets its owner's (restored) shard
        if self.cfg.hang_timeout > 0:  # before the watcher reads it; armed after 1 iteration
            from reft_ext.cluster.heartbeat import Heartbeat

            self.heartbeat = Heartbeat(self.snap.store.dir, self.adapter.rank, state.iteration)
            self.snap.events.heartbeat = self.heartbeat
        self._start_watcher()
        self.snap.signals.set(node_status.HEALTHY,
                              detail=f"training from iteration {state.iteration}")

    def _start_watcher(self):
        """Save-on-failure: the node's first rank starts a watcher of the node's workers
        (its own session, so it outlives them; reft_ext/cluster/watcher.py)."""
        from reft_ext.cluster.watcher import spawn

        a, sig = self.adapter, self.snap.signals
        pids = [None] * a.world_size
        torch.distributed.all_gather_object(pids, os.getpid(), group=a.control_group)
        if sig.leader:
            spawn(self.cfg.shm_dir, self.cfg.job_id, sig.node, [pids[r] for r in sig.ranks],
                  self.cfg.flush_dir, ranks=sig.ranks, hang_timeout=self.cfg.hang_timeout)

    def after_step(self, state):
        now = time.perf_counter()
        if self._t_step is not None:
            self.iteration_s.append(now - self._t_step)
        self._t_step = now
        self.snap.maybe_verify_aor(state.iteration)
        rolled_back = False
        if self.rollback_cfg.enabled:
            reason = self.detector.observe(state.iteration, *self._job_wide(state.report))
            if reason is not None:  # this iteration is not snapshotted: it is undone
                self.rollback(state, reason)
                rolled_back = True
        if not rolled_back and state.iteration % self.cfg.snapshot_every == 0:
            summary.count_snapshot(state.extra)  # before the capture: it is in the snapshot
            self.snap.maybe_snapshot(state.iteration)
        if self.heartbeat is not None:
            self.heartbeat.iteration_done(state.iteration)

    # ---- loss-spike rollback (reft_ext/load/rollback.py) ---------------------------------
    def _job_wide(self, report: dict) -> tuple[float | None, float | None]:
        """(loss, grad norm) as every rank must see them: the loss lives on the last
        pipeline stage, and a NaN in one rank's gradients may not reach every rank's grad
        norm (DP replicas clip separately): MAX over the job, non-finite flags beside."""
        vals = []
        for v in (report.get("loss"), report.get("grad_norm")):
            v = None if v is None else float(v)
            finite = v is not None and math.isfinite(v)
            vals += [v if finite else -math.inf, 0.0 if v is None or finite else 1.0]
        t = torch.tensor(vals, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                     group=self.adapter.control_group)
        out = []
        for value, bad in ((t[0].item(), t[1].item()), (t[2].item(), t[3].item())):
            out.append(math.nan if bad else (None if value == -math.inf else value))
        return out[0], out[1]

    def rollback(self, state, reason: str) -> None:
        """Every rank, in process: back to the oldest snapshot of the ring, AOR replicas
        re-synchronized, the data position moved past --reft-skip-batches batches."""
        spike = state.iteration
        t0 = time.perf_counter()
        mine = [int(m["iteration"]) for m in self.snap.store.manifests().values()]
        target = torch.tensor([min(mine) if mine else -1], dtype=torch.int64)
        torch.distributed.all_reduce(target, op=torch.distributed.ReduceOp.MAX,
                                     group=self.adapter.control_group)
        target = int(target.item())
        if target < 0:
            raise RollbackError(f"--reft-rollback-on: {reason} at iteration {spike} and "
                                f"no snapshot in host memory to roll back to")
        if self.snap.aor is not None:
            self.snap.aor.pause()
        it = recover(self.snap, None, max_iteration=target)
        if it is None:
            raise RollbackError(f"--reft-rollback-on: {reason} at iteration {spike}; "
                                f"the snapshots up to iteration {target} could not be "
                                f"restored (see the [REFT] line above)")
        # the snapshots after the target hold state from inside the spike: gone before
        # anything else can read them (a crash now must not bring the spike back)
        self.snap.store.discard_newer(it)
        if self.snap.aor is not None:
            self.snap.aor.initialize()  # holders take their owners' restored shards
        n = self.detector.rolled_back(spike, it)
        gbs, first = self.args.global_batch_size, state.consumed_train_samples
        skip = self.rollback_cfg.skip_batches * gbs
        state.consumed_train_samples += skip
        summary.count_rollback(state.extra)
        skipped = (f"samples {first}-{first + skip - 1}" if skip else "nothing")
        if self.adapter.rank == 0:
            reft_print(f"rollback: {reason} at iteration {spike} -> iteration {it} restored "
                       f"from host memory in {1000 * (time.perf_counter() - t0):.1f} ms; "
                       f"skipped {self.rollback_cfg.skip_batches} global batch(es): "
                       f"{skipped}; rollback {n} of at most "
                       f"{self.rollback_cfg.rollback_limit} within "
                       f"{self.rollback_cfg.spike_window} iterations")

    def before_optimizer_step(self, state):
        self.snap.before_optimizer_step()
        if self.heartbeat is not None:
            # snapshot committed, the step's collectives not begun: a rank stuck here
            # waits for no one (this is where --inject-fault R:ITER:STOP freezes a rank)
            self.heartbeat.work()

    def on_exit(self, state):
        torch.distributed.barrier(group=self.adapter.control_group)
        self.snap.flush()
        # before any worker exits: the watcher must not take the exit for a failure
        self.snap.signals.set(node_status.FINISHED, detail=f"training ended at iteration "
                              f"{state.iteration}")
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.snap.aor is not None:
            checks = torch.tensor(self.snap.aor_checks, dtype=torch.int64)
            torch.distributed.all_reduce(checks, group=self.adapter.control_group)
            if self.adapter.rank == 0:
                reft_print(f"aor: {checks[0].item()} replica verifications over "
                           f"{self.adapter.world_size} ranks, {checks[1].item()} mismatches")
        if self.adapter.rank == 0 and self.cfg.enabled:
            reft_print(self.summary(state))
        self.snap.close(remove=not self.cfg.keep_snapshots)

    def summary(self, state) -> str:
        snap = self.snap
        regions = {(snap.protection.name if k == "redundancy" else k): n
                   for k, (_, n) in snap.regions.items()}
        return summary.format_summary(
            extra=state.extra, every=self.cfg.snapshot_every, regions=regions,
            blocked_s=snap.blocked_history, iteration_s=self.iteration_s,
            host_bytes_per_node=snap.host_bytes_per_node(),
            nodes=self.adapter.world_size // self.cfg.ranks_per_node,
            protection=self.cfg.protect)

    # ---- fault injection (tests) -----------------------------------------------
    def _fault_in_snapshot(self, iteration):
        for f in self.faults:
            if f.mode == "snapshot" and f.iteration == iteration:
                fault_injection.fire(f, "during its snapshot write")

    def wipe_node(self):
        """Node loss: the failure domain's shared memory disappears with the node."""
        d = job_dir(self.snap.store.job, self.cfg.shm_dir)
        shutil.rmtree(d, ignore_errors=True)
        reft_print(f"[FAULT] wiped failure domain {self.cfg.node_of(self.adapter.rank)} ({d})")

    def corrupt(self, mode: str):
        """--inject-fault ...:corrupt*: damage this rank's committed snapshot (tests).
        The bytes are mapped shared on a tmpfs: the change is what any process reads
        from now on, a kill right after does not lose it."""
        store, snap = self.snap.store, self.snap
        c = store.committed()
        if c is None:
            return
        slot, it, who = c["slot"], int(c["iteration"]), f"rank {self.adapter.rank}'s"
        if mode in ("corrupt", "corrupt-replica"):
            region = "own" if mode == "corrupt" else "redundancy"
            off, n = snap.regions[region]
            if n == 0:
                emit(f"[FAULT] {who} snapshot has no {region} region: nothing flipped")
                return
            store.data(slot, snap.nbytes)[off + n // 2] ^= 0xFF
            if mode == "corrupt":
                emit(f"[FAULT] flipped a byte of {who} snapshot of iteration {it}")
            else:
                a = self.adapter
                peer = a.dp_ranks[(a.dp_ranks.index(a.rank) + 1) % len(a.dp_ranks)]
                held = f"ARC replica of rank {peer}'s slice" if snap.protection.name == \
                    "arc" else f"{snap.protection.name} redundancy block"
                emit(f"[FAULT] flipped a byte of {who} {held} in its snapshot of "
                     f"iteration {it}")
            return
        # still valid JSON, one value changed, the stored checksum (self_sha256) kept:
        # only the file's own checksum can tell
        if mode == "corrupt-manifest":
            path = store._path(store._name(slot, "json"))
            with open(path) as f:
                m = json.load(f)
            meta = from_jsonable(m["meta"])
            counters = meta["counters"]
            was = counters["consumed_train_samples"]
            counters["consumed_train_samples"] = was + self.args.global_batch_size
            m["meta"] = to_jsonable(meta)
            change = (f"consumed_train_samples {was} -> "
                      f"{counters['consumed_train_samples']} in {who} manifest {path} of "
                      f"iteration {it}")
        else:  # corrupt-committed
            path = store._path(f"rank{self.adapter.rank}.committed")
            with open(path) as f:
                m = json.load(f)
            m["iteration"] = it + 1
            change = f"{who} commit pointer {path}: iteration {it} -> {it + 1}"
        with open(path, "w") as f:
            json.dump(m, f)
        emit(f"[FAULT] changed {change} (checksum kept)")
