"""REFT as a training loop sees it: one object, four hook methods and a few calls.

A trainer builds a :class:`ReftSession` from a :class:`~reft_ext.config.ReftConfig` and a
:class:`SessionAdapter` (its state split into replicated and owned tensors, its process
groups; megatron/training/reft_integration.py has Megatron's), or a
:class:`DisabledSession` when snapshots are off: same interface, nothing happens, so the
loop never asks whether REFT is on. The call order of one process::

    s.recover(persistent_iteration)        # start-up: host memory, flushed tier, reshard
    s.on_start(state)                      # AOR replicas, heartbeat, node watcher
    per iteration: s.before_optimizer_step(state); s.after_step(state)
    with s.heartbeat_paused(): ...         # checkpoint saves, validation
    s.pause_heartbeat(); s.on_exit(state); s.write_trace()

``state`` is the trainer's loop state (:class:`LoopState`). This module is the only one
of reft_ext that joins the pieces (save, load, cluster, report); it imports no trainer.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import math
import os
import time
from typing import Protocol

import torch

from reft_ext.cluster import inprocess
from reft_ext.cluster import status as node_status
from reft_ext.config import ReftConfig
from reft_ext.load import preverify
from reft_ext.load.recover import recover
from reft_ext.load.view import SnapshotView
from reft_ext.load.rollback import (RollbackConfig, RollbackError, SpikeDetector,
                                    batches_to_skip)
from reft_ext.report import summary
from reft_ext.report.events import emit as reft_emit, record
from reft_ext.save.snapshotter import ReftSnapshotter, StateAdapter, reft_print
from reft_ext.sigterm_guard import SigtermGuard
from reft_ext.state.identity import refuse_other_runs
from reft_ext.store.paths import node_dir
from reft_ext.testing import collectives, fault_point
from reft_ext.store.shm import ShmDirError, ensure_private_dir


class SessionAdapter(StateAdapter, Protocol):
    """The snapshotter's :class:`StateAdapter` plus what the session itself needs."""

    global_batch_size: int   # samples per iteration (a rollback skips whole batches)
    # optional: the groups the loss-spike verdict is agreed over (default: the whole job)
    # verdict_groups: list

    def identity(self) -> dict: ...  # what makes a state this run's (state/identity.py)


class LoopState(Protocol):
    """The trainer's state as the hook methods read it."""

    iteration: int                 # iterations completed
    consumed_train_samples: int    # the data position (a rollback moves it on)
    extra: dict                    # small JSON part, in every snapshot (REFT's counters)
    report: dict                   # this iteration's {"loss": ..., "grad_norm": ...}


class Session(abc.ABC):
    """What the trainer calls, whether REFT is on (:class:`ReftSession`) or off
    (:class:`DisabledSession`): one interface, so no call site asks which it holds.
    ``tests/unit/test_session_interface.py`` checks that both implement all of it with
    the same signatures."""

    enabled: bool

    @abc.abstractmethod
    def recover(self, persistent_iteration: int | None) -> int | None: ...
    @abc.abstractmethod
    def count_recovery(self, tier: str) -> None: ...
    @abc.abstractmethod
    def recovered_from_checkpoint(self, path: str) -> None: ...
    @abc.abstractmethod
    def on_start(self, state) -> None: ...
    @abc.abstractmethod
    def before_optimizer_step(self, state) -> None: ...
    @abc.abstractmethod
    def after_step(self, state) -> None: ...
    @abc.abstractmethod
    def rollback(self, state, reason: str) -> None: ...
    @abc.abstractmethod
    def heartbeat_paused(self): ...
    @abc.abstractmethod
    def pause_heartbeat(self) -> None: ...
    @abc.abstractmethod
    def on_exit(self, state) -> None: ...
    @abc.abstractmethod
    def commit_in_flight(self) -> None:
        """Finish and commit the snapshot in flight now (collective: every rank calls
        it at the same iteration; a straggler swap takes its restart right after)."""
    @abc.abstractmethod
    def abandon(self) -> None:
        """This generation failed (in-process restart): stop without committing."""
    @abc.abstractmethod
    def close(self) -> None: ...
    @abc.abstractmethod
    def release_start(self) -> None: ...
    @abc.abstractmethod
    def summary(self, state) -> str: ...
    @abc.abstractmethod
    def write_trace(self) -> None: ...


class _Trace:
    """The Chrome trace of ``--reft-trace-file`` (with or without snapshots)."""

    def __init__(self, trace_file: str = "", events=None, trace_group=None):
        self.trace_file, self.events, self.trace_group = trace_file, events, trace_group

    def write_trace(self) -> None:
        """Collective: every rank's events to rank 0, one Chrome trace file."""
        if not self.trace_file or self.events is None:
            return
        from reft_ext.report.timeline import write_chrome_trace

        tr = self.events.trace
        world = torch.distributed.get_world_size()
        gathered = [None] * world if tr.rank == 0 else None
        torch.distributed.gather_object((tr.chrome_events(), tr.dropped), gathered, dst=0,
                                        group=self.trace_group)
        if tr.rank == 0:
            write_chrome_trace(self.trace_file, [g[0] for g in gathered],
                               sum(g[1] for g in gathered))
            path = os.path.abspath(self.trace_file)
            reft_emit("trace", f"trace of {world} ranks written to {path}", ranks=world,
                      path=path)


class DisabledSession(_Trace, Session):
    """REFT off (``--reft-snapshot-every 0``): the session's interface, doing nothing
    (but the trace, which ``--reft-trace-file`` asks for without snapshots too)."""

    enabled = False
    snap = None

    def recover(self, persistent_iteration: int | None) -> int | None:
        return None

    def count_recovery(self, tier: str) -> None:
        pass

    def recovered_from_checkpoint(self, path: str) -> None:
        pass

    def on_start(self, state) -> None:
        pass

    def before_optimizer_step(self, state) -> None:
        pass

    def after_step(self, state) -> None:
        pass

    def rollback(self, state, reason: str) -> None:
        raise RollbackError(f"rollback ({reason}) needs --reft-snapshot-every >= 1")

    def heartbeat_paused(self):
        return contextlib.nullcontext()

    def pause_heartbeat(self) -> None:
        pass

    def on_exit(self, state) -> None:
        pass

    def commit_in_flight(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass

    def release_start(self) -> None:
        pass

    def summary(self, state) -> str:
        return ""


class ReftSession(_Trace, Session):
    """One rank's REFT: snapshots after each step, REFT-load at start-up, loss-spike
    rollback, heartbeat and node watcher, clean-up and summary at the end."""

    enabled = True

    def __init__(self, cfg: ReftConfig, adapter: SessionAdapter, state: LoopState, *,
                 events=None, trace_group=None, rollback: RollbackConfig | None = None,
                 fused_load: bool = True):
        """``fused_load``: REFT-load may write the newest slot into the model while it
        verifies it (False when a persistent load that follows a failure would not
        overwrite every byte, e.g. --no-load-optim; reft_ext/load/recover.py)."""
        super().__init__(cfg.trace_file, events, trace_group)
        self.cfg, self.adapter, self.state = cfg, adapter, state
        self.snap = None
        self._closed = False
        self._node_dir = node_dir(cfg.shm_dir, cfg.job_id, cfg.node_of(adapter.rank))
        self._start_files = self._check_shm_dir()
        try:
            self.snap = ReftSnapshotter(cfg, adapter, events)
        except BaseException:  # a placement or memory error: nothing of this start stays
            self.release_start()
            raise
        self.heartbeat = None  # --reft-hang-timeout (reft_ext/cluster/heartbeat.py), on_start
        self.fused_load = fused_load
        self.rollback_cfg = rollback or RollbackConfig(rollback_on="off")
        self.detector = SpikeDetector(self.rollback_cfg)
        self._t_step: float | None = None
        # this process's iteration times (the summary's median): the last WINDOW only
        self.iteration_s = summary.Window()
        self._term = SigtermGuard(self)  # SIGTERM: the snapshot in flight commits first
        # set by a trainer that opens this session after an in-process restart
        self.restarted_in_process = False
        self._hook_s = self._hook_cpu = 0.0  # this iteration's hooks: wall, CPU
        collectives.maybe_install()  # REFT_COUNT_COLLECTIVES=1 only (issue 34's checks)

    def _check_shm_dir(self) -> set[str]:
        """Before any segment exists: each rank's failure-domain directory must be this
        user's own (another user's, e.g. another job under the same --reft-job-id, is
        never written into). Job-wide, so every rank stops with the same one line
        instead of the others hanging in their next collective. Returns this rank's
        files already there (what :meth:`release_start` keeps)."""
        a = self.adapter
        d = self._node_dir
        mine = set()
        try:
            ensure_private_dir(d)
            mine = {n for n in os.listdir(d) if n.startswith(f"rank{a.rank}.")}
            why = None
        except ShmDirError as exc:
            why = str(exc)
        seen = [None] * a.world_size
        torch.distributed.all_gather_object(seen, why, group=a.control_group)
        why = next((w for w in seen if w), None)
        if why:
            raise ShmDirError(errno.EACCES, why)
        return mine

    def release_start(self) -> None:
        """A start refused after the session opened (a placement error, a checkpoint of
        another layout, another run's snapshots ...): this rank's segments created since
        it opened are removed, and the node's directory once it is empty. Files that
        were there before stay: a refused restart must not destroy the snapshots that a
        corrected one recovers from."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_term", None) is not None:
            self._term.uninstall()
        if self.snap is not None:
            self.snap.abandon()  # threads stopped (the background reservation joined)
            self.snap.store.close()
        try:
            names = os.listdir(self._node_dir)
        except OSError:
            return
        for name in names:
            if name.startswith(f"rank{self.adapter.rank}.") and \
                    name not in self._start_files:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self._node_dir, name))
        with contextlib.suppress(OSError):  # the node's other ranks may still hold files
            os.rmdir(self._node_dir)

    # ---- start-up ------------------------------------------------------------------
    def recover(self, persistent_iteration: int | None) -> int | None:
        """Collective. The iteration restored from host memory (or the flushed tier, or
        resharded after a shrink) into the trainer's state, or None: the trainer loads
        its persistent checkpoint instead (``persistent_iteration``, newer wins)."""
        # another run's snapshots (same --reft-job-id, other seed/model/data...): refuse
        # job-wide before anything is read or imported
        from reft_ext.load.flushed import flushed_manifests

        on_disk = flushed_manifests(self.cfg.flush_dir, self.adapter.rank) \
            if self.cfg.flush_dir else None
        why = refuse_other_runs(self.snap.store, self.cfg.flush_dir, self.adapter.identity(),
                                self.adapter.control_group, on_disk)
        if why:
            from reft_ext.load.errors import IdentityMismatch

            raise IdentityMismatch(why)
        if self.cfg.flush_dir:  # save-on-failure tier: back into memory when newer
            from reft_ext.load.flushed import import_flushed

            flushed = import_flushed(self.snap.store, self.cfg.flush_dir, self.snap.nbytes)
            if flushed is not None:
                reft_print(f"rank {self.adapter.rank}: host memory had nothing newer than "
                           f"the flushed snapshot of iteration {flushed} in {self.cfg.flush_dir}: "
                           f"loaded it into host memory", event="imported_flushed",
                           rank=self.adapter.rank, iteration=flushed,
                           flush_dir=self.cfg.flush_dir)
        from reft_ext.load.reshard import reshard_from_memory

        # after an elastic shrink (docs/nodes.md): the old job's snapshots, resharded
        it = reshard_from_memory(self.snap, persistent_iteration, direct=self.fused_load)
        if it is not None:
            self.count_recovery("memory, resharded after a shrink")
            return it
        # a fused restore that fails a checksum leaves bytes in the model that only a
        # full persistent load replaces (reft_ext/load/recover.py recover)
        it = recover(self.snap, persistent_iteration, fuse=self.fused_load)
        if it is not None:
            self.count_recovery(self.snap.recovered_from or "host memory")
        return it

    def count_recovery(self, tier: str) -> None:
        """One recovery of the job, by the tier that served it (kept in the state)."""
        summary.count_recovery(self.state.extra, tier)

    def recovered_from_checkpoint(self, path: str) -> None:
        """The trainer loaded its persistent checkpoint after REFT-load found nothing
        newer: logged and counted as a recovery like the others."""
        if self.adapter.rank == 0:
            reft_print(f"recovered iteration {self.state.iteration} from the persistent "
                       f"checkpoint {path}")
        # every rank (one line above)
        record("recovered_persistent", iteration=self.state.iteration, path=path)
        self.count_recovery("the persistent checkpoint")

    def on_start(self, state) -> None:
        fault_point("on-start", iteration=state.iteration)  # --inject-fault ...@on-start
        preverify.discard()  # checksums begun at an abandon that no REFT-load took
        self.snap.start()  # AOR: every holder gets its owner's (restored) shard
        if self.cfg.hang_timeout > 0:  # before the watcher reads it; armed after 1 iteration
            from reft_ext.cluster.heartbeat import Heartbeat

            self.heartbeat = Heartbeat(self.snap.store.dir, self.adapter.rank, state.iteration)
            self.snap.events.heartbeat = self.heartbeat
        self._start_watcher()
        self.snap.signals.set(node_status.HEALTHY,
                              detail=f"training from iteration {state.iteration}")
        self._term.install()
        # a replacement's slots (a GB or more) are made from here, beside the first
        # forward-backward: populating them holds a core and the process's mmap lock,
        # which stalled the start-up's collectives of every rank by 0.2-0.4 s
        self.snap.store.release_slots()

    def _start_watcher(self) -> None:
        """Save-on-failure: the node's first rank starts a watcher of the node's workers
        (its own session, so it outlives them; reft_ext/cluster/watcher.py)."""
        from reft_ext.cluster.watcher import spawn

        a, sig = self.adapter, self.snap.signals
        pids = [None] * a.world_size
        torch.distributed.all_gather_object(pids, os.getpid(), group=a.control_group)
        if not sig.leader:
            return
        cfg, mine = self.cfg, [pids[r] for r in sig.ranks]
        if not inprocess.enabled():  # torchrun: one watcher per start of the workers
            spawn(cfg.shm_dir, cfg.job_id, sig.node, mine, cfg.flush_dir, ranks=sig.ranks,
                  hang_timeout=cfg.hang_timeout)
            return
        # in-process: the node's watcher stays for the job and is handed each
        # generation's ranks (no Python start per node beside the first iteration after
        # a recovery); one is started where the node has none (the first start, a node
        # whose ranks all died, a spare node)
        gen = int(os.environ.get(inprocess.ENV_GENERATION, "0"))
        if node_status.adopt_watcher(cfg.shm_dir, cfg.job_id, sig.node, gen, mine, sig.ranks):
            return
        node_status.kill_watcher(cfg.shm_dir, cfg.job_id, sig.node)  # one not adopting
        # written first: a list a watcher of an earlier generation left is never adopted
        node_status.write_watch_list(cfg.shm_dir, cfg.job_id, sig.node, gen, mine, sig.ranks)
        spawn(cfg.shm_dir, cfg.job_id, sig.node, mine, cfg.flush_dir, ranks=sig.ranks,
              hang_timeout=cfg.hang_timeout, adopt=True)

    # ---- every iteration -----------------------------------------------------------
    def before_optimizer_step(self, state) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self._before_optimizer_step()
        self._hook_s += time.perf_counter() - t0
        self._hook_cpu += time.thread_time() - c0

    def _before_optimizer_step(self) -> None:
        self._term.busy = True
        self.snap.before_optimizer_step()  # the snapshot in flight completes first
        self._term.busy = False
        self._term.safe_point()  # a SIGTERM meanwhile: terminate now, this step undone
        if self.heartbeat is not None:
            # snapshot committed, the step's collectives not begun: a rank stuck here
            # waits for no one (this is where --inject-fault R:ITER:STOP freezes a rank)
            self.heartbeat.work()

    def after_step(self, state) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self._after_step(state)
        # REFT's part of this iteration (REFT_COUNT_COLLECTIVES=1: its collectives too);
        # CPU time beside wall time: on an oversubscribed host the wall time inside a
        # hook grows with the ranks waiting for a core, the CPU time only with the work
        collectives.end_iteration(state.iteration,
                                  self._hook_s + time.perf_counter() - t0,
                                  self._hook_cpu + time.thread_time() - c0)
        self._hook_s = self._hook_cpu = 0.0

    def _after_step(self, state) -> None:
        # the iteration is complete: a SIGTERM from here waits for its snapshot's commit
        self._term.stepping = state.iteration % self.cfg.snapshot_every == 0
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
        self._term.stepping = False
        self._term.safe_point()  # end-of-iteration: committed above; has: in flight

    def heartbeat_paused(self):
        """Checkpoint saves and validation beat nowhere and may outlast
        --reft-hang-timeout: hang detection pauses for them (cluster/heartbeat.py)."""
        return self.heartbeat.paused() if self.heartbeat is not None \
            else contextlib.nullcontext()

    def pause_heartbeat(self) -> None:
        """From here to the end (the final save, the shutdown): not judged."""
        if self.heartbeat is not None:
            self.heartbeat.pause()

    # ---- loss-spike rollback (reft_ext/load/rollback.py) ---------------------------
    def _job_wide(self, report: dict) -> tuple[float | None, float | None]:
        """(loss, grad norm) as every rank must see them: MAX, non-finite flags beside,
        over the adapter's ``verdict_groups``, the smallest groups that make the verdict
        the same everywhere (the Megatron adapter: the pipeline group, as the loss lives
        on the last stage; the data-parallel group where no world-wide grad norm exists,
        i.e. without the distributed optimizer; none at all for PP 1 with it). An adapter
        without them: the whole job."""
        vals = []
        for v in (report.get("loss"), report.get("grad_norm")):
            v = None if v is None else float(v)
            finite = v is not None and math.isfinite(v)
            vals += [v if finite else -math.inf, 0.0 if v is None or finite else 1.0]
        t = torch.tensor(vals, dtype=torch.float64)
        groups = getattr(self.adapter, "verdict_groups", None)
        for group in ([self.adapter.control_group] if groups is None else groups):
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        out = []
        for value, bad in ((t[0].item(), t[1].item()), (t[2].item(), t[3].item())):
            out.append(math.nan if bad else (None if value == -math.inf else value))
        return out[0], out[1]

    def rollback(self, state, reason: str) -> None:
        """Every rank, in process: back to the oldest snapshot of the ring (not counting
        the slot local commits add), AOR replicas re-synchronized, the data position
        moved past the spiking batch (and on to --reft-skip-batches batches from the
        restored position, if that is further)."""
        # the data position after the spiking iteration: the end of the batch that spiked
        spike, spike_end = state.iteration, state.consumed_train_samples
        t0 = time.perf_counter()
        mine = sorted(int(m["iteration"]) for m in self.snap.store.manifests().values())
        # local commits keep one slot more for their one-iteration skew
        # (store/commit.py): it does not reach further back, --reft-keep 3 reaches as far
        # as 2 did with job-wide commits
        mine = mine[-(self.cfg.keep - self.cfg.local_commits):]
        target = torch.tensor([mine[0] if mine else -1], dtype=torch.int64)
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
            # holders take their owners' restored shards (or keep them: same bytes)
            self.snap.aor.initialize(seed=self.snap.aor_seed())
        n = self.detector.rolled_back(spike, it)
        # through the spiking batch, whatever the ring's depth (load/rollback.py)
        skip = batches_to_skip(it, spike, state.consumed_train_samples, spike_end,
                               self.adapter.global_batch_size, self.rollback_cfg.skip_batches)
        state.consumed_train_samples = skip.last + 1
        summary.count_rollback(state.extra)
        if self.adapter.rank == 0:
            reft_print(f"rollback: {reason} at iteration {spike} -> iteration {it} restored "
                       f"from host memory in {1000 * (time.perf_counter() - t0):.1f} ms; "
                       f"{skip.text()}; rollback {n} of at most "
                       f"{self.rollback_cfg.rollback_limit} within "
                       f"{self.rollback_cfg.spike_window} iterations", event="rollback",
                       reason=reason, spike=spike, iteration=it,
                       ms=1000 * (time.perf_counter() - t0), skip_batches=skip.batches,
                       iterations=[it + 1, spike], after_spike=skip.after_spike,
                       samples=[skip.first, skip.last], count=n,
                       limit=self.rollback_cfg.rollback_limit,
                       window=self.rollback_cfg.spike_window)

    # ---- the end -------------------------------------------------------------------
    def on_exit(self, state) -> None:
        torch.distributed.barrier(group=self.adapter.control_group)
        self.snap.flush()
        self.snap.log_interval()  # the window the run ends in, if its line is still due
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
                           f"{self.adapter.world_size} ranks, {checks[1].item()} mismatches",
                           event="aor_checks", verifications=checks[0].item(),
                           ranks=self.adapter.world_size, mismatches=checks[1].item())
        if self.adapter.rank == 0 and self.cfg.enabled:
            reft_print(self.summary(state))
        self.close()

    def commit_in_flight(self) -> None:
        self.snap.flush()

    def abandon(self) -> None:
        """In-process restart (reft_ext/cluster/inprocess.py): this generation failed.
        Nothing is committed, flushed or waited for (peers may be dead); threads stop,
        the heartbeat ends (paused first, so the node watcher does not judge the
        restart a hang) and the segments stay in shared memory for the next session's
        recovery."""
        if self._closed:
            return
        self._closed = True
        self._term.uninstall()
        if self.heartbeat is not None:
            self.heartbeat.pause()
            self.heartbeat.close()
        self.snap.abandon(self._preverify)

    def _preverify(self, store):
        """At the abandon: the next REFT-load's first checksums, begun on a thread while
        the job re-forms (reft_ext/load/preverify.py); the thread, for the hand-over."""
        fmt = SnapshotView.of(self.snap).slot_format
        return preverify.start((store.dir, store.rank), store.manifests(), fmt,
                               store.mapped(self.snap.nbytes)).thread

    def close(self) -> None:
        """The snapshots' segments unmapped, and removed unless --reft-keep-snapshots."""
        if not self._closed:
            self._closed = True
            # a SIGTERM during the final flush: everything is committed, the run ends
            self._term.uninstall()
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

