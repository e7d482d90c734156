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

``state`` is the trainer's loop state (:class:`LoopState`). This module (with its
start-up half, reft_ext/session_startup.py) is the only one of reft_ext that joins the
pieces (save, load, cluster, report); it imports no trainer. The interface and
:class:`DisabledSession` live in reft_ext/session_interface.py; every name is
importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time

import torch

from reft_ext.cluster import status as node_status
from reft_ext.config import ReftConfig
from reft_ext.load import preverify
from reft_ext.load.recover import recover
from reft_ext.load.view import SnapshotView
from reft_ext.load.rollback import (RollbackConfig, RollbackError, SpikeDetector,
                                    batches_to_skip)
from reft_ext.report import summary
from reft_ext.save.snapshotter import ReftSnapshotter, reft_print
from reft_ext.session_interface import (DisabledSession, LoopState, Session, SessionAdapter,
                                        _Trace)
from reft_ext.session_startup import SessionStartup
from reft_ext.sigterm_guard import SigtermGuard
from reft_ext.store.paths import node_dir
from reft_ext.testing import collectives
from reft_ext.store.shm import ShmDirError, ShmSpaceError, ensure_private_dir


__all__ = ["SessionAdapter", "LoopState", "Session", "DisabledSession", "ReftSession",
           "SnapshotsUnavailable"]


class SnapshotsUnavailable(RuntimeError):
    """A restart found too little shared memory for its snapshots (another process,
    perhaps another user's, filled it): the trainer goes on without snapshots, from its
    persistent checkpoint (megatron/training/reft_integration.py open_session)."""


class ReftSession(_Trace, SessionStartup, Session):
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
        full = None
        try:
            self.snap = ReftSnapshotter(cfg, adapter, events)
        except ShmSpaceError as exc:  # agreed job-wide below
            full = str(exc)
        except BaseException:  # a placement or memory error: nothing of this start stays
            self.release_start()
            raise
        self._check_space(full)
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
        # this process's hooks: wall seconds, iterations, of the seconds those waiting
        # for the slowest rank in the job-wide commit (:meth:`take_peer_wait`)
        self.hooks_total = [0.0, 0, 0.0]
        self._waited = 0.0  # this iteration's share of the third
        self.calibration = None  # --reft-calibrate-iters (made at the first iteration)
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

    def _check_space(self, full: str | None) -> None:
        """Too little shared memory for a rank's snapshots (its ShmSpaceError, ``full``):
        at a first start the error stands (the footprint does not fit: the user's to
        fix); at a restart (torchrun's or in-process, or snapshots of an earlier attempt
        here), where /dev/shm may have been filled since, by another user too, every rank
        turns snapshots off instead (SnapshotsUnavailable) and the job goes on from its
        persistent checkpoint. Job-wide, in one all_gather every rank enters."""
        a = self.adapter
        restarted = bool(self._start_files) or any(
            int(os.environ.get(v, "0") or 0) > 0
            for v in ("TORCHELASTIC_RESTART_COUNT", "REFT_GENERATION"))
        seen = [None] * a.world_size
        torch.distributed.all_gather_object(seen, (full, restarted), group=a.control_group)
        full = next((f for f, _ in seen if f), None)
        if full is None:
            return
        self.release_start()  # this start's segments and threads, on every rank
        if any(r for _, r in seen):
            raise SnapshotsUnavailable(full)
        raise ShmSpaceError(errno.ENOSPC, full)

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
            os.rmdir(os.path.dirname(self._node_dir))  # the job's parent, once empty

    # ---- start-up: recover, count_recovery, recovered_from_checkpoint, on_start ------
    # (SessionStartup, reft_ext/session_startup.py)

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
        wall = self._hook_s + time.perf_counter() - t0
        collectives.end_iteration(state.iteration, wall,
                                  self._hook_cpu + time.thread_time() - c0)
        self.hooks_total[0] += wall
        self.hooks_total[1] += 1
        # the [REFT] snapshots line's figure: what goodput books (the wait left out)
        self.snap.log.hooks_s.append(max(0.0, wall - self._waited))
        self._hook_s = self._hook_cpu = self._waited = 0.0

    def _after_step(self, state) -> None:
        cal = self._calibrate(state.iteration)
        due = state.iteration % self.cfg.snapshot_every == 0 and \
            (cal is None or cal.snapshot_due(state.iteration))
        # the iteration is complete: a SIGTERM from here waits for its snapshot's commit
        self._term.stepping = due
        now = time.perf_counter()
        if self._t_step is not None:
            self.iteration_s.append(now - self._t_step)
            if cal is not None and cal.observe(state.iteration, now - self._t_step) and \
                    self.adapter.rank == 0 and cal.text():
                reft_print(cal.text(), event="calibration", **cal.result())
        self._t_step = now
        self.snap.maybe_verify_aor(state.iteration)
        rolled_back = False
        if self.rollback_cfg.enabled:
            reason = self.detector.observe(state.iteration, *self._verdict_inputs(state.report))
            if reason is not None:  # this iteration is not snapshotted: it is undone
                self.rollback(state, reason)
                rolled_back = True
        if not rolled_back and due:
            summary.count_snapshot(state.extra)  # before the capture: it is in the snapshot
            self.snap.maybe_snapshot(state.iteration)
        if self.heartbeat is not None:
            self.heartbeat.iteration_done(state.iteration)
        self._term.stepping = False
        self._term.safe_point()  # end-of-iteration: committed above; has: in flight

    def _calibrate(self, iteration: int):
        """The --reft-calibrate-iters A/B (reft_ext/report/calibration.py), made at the
        first iteration this process completes (every rank the same)."""
        if self.calibration is None and self.cfg.calibrate_iters > 0:
            from reft_ext.report.calibration import Calibration

            self.calibration = Calibration(self.cfg.calibrate_iters, iteration)
        return self.calibration

    def take_peer_wait(self) -> float:
        """Seconds of the hooks since the last call spent waiting for the slowest rank in
        the job-wide commit: the step's own all-reduce (the grad norm's, over the whole
        job) would wait as long without REFT, so goodput books them productive (the
        pipeline's waiting, moved), not REFT's (issue 57, docs/has.md)."""
        w, self.snap.peer_wait_s = self.snap.peer_wait_s, 0.0
        self.hooks_total[2] += w
        self._waited += w
        return w

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
    def _verdict_inputs(self, report: dict) -> tuple[float | None, float | None]:
        """(loss, grad norm) for the verdict. ``--reft-rollback-on nan`` where the grad
        norm is already the job's (the adapter's ``grad_norm_job_wide``: megatron-core's
        distributed optimizer reduces it over the whole job): that alone, no collective
        (a non-finite loss makes non-finite gradients); the rank never waits for its
        peers here (that all-reduce was most of REFT's per-iteration hook time: issue 57,
        docs/has.md). Otherwise both, made the same everywhere (:meth:`_job_wide`)."""
        if self.rollback_cfg.rollback_on == "nan" and \
                getattr(self.adapter, "grad_norm_job_wide", False):
            gn = report.get("grad_norm")
            return None, None if gn is None else float(gn)
        return self._job_wide(report)

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
        # REFT's hooks over the job (what goodput books as "snapshot"): the summary's
        hooks = torch.tensor(self.hooks_total, dtype=torch.float64)
        torch.distributed.all_reduce(hooks, group=self.adapter.control_group)
        self._job_hooks = (hooks[0].item(), int(hooks[1].item()), self.adapter.world_size,
                           hooks[2].item())
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
            protection=self.cfg.protect, hooks=getattr(self, "_job_hooks", None),
            calibration=None if self.calibration is None else self.calibration.result())
