"""The training loop: megatron-core schedules and optimizers, Megatron-LM's log lines.

``pretrain(args)`` builds everything, loads ``--load`` if given, trains to
``--train-iters`` and saves. ``hooks`` are :class:`~megatron.training.hooks.TrainerHook`
objects; REFT's session (reft_ext/session.py, built in reft_integration.py) is the first
of them, and everything else REFT does for the loop is one of its methods.
"""

from __future__ import annotations

import gc
import math
import os
import time
import uuid
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.timers import Timers

from megatron.training import (children, fallbacks, fault_injection, inprocess,
                               inprocess_generation, llama_model)
from megatron.training.checkpointing import Checkpointer
from megatron.training.goodput_integration import GoodputTracker
from megatron.training.initialize import initialize_megatron
from megatron.training.arguments import format_args_table
from megatron.training.signals import ExitSignal
from megatron.training.straggler_swap import take_swap
from megatron.training.train_log import TrainLogger
from megatron.training.train_state import TrainingState, params_hash
from megatron.training.utils import emit, print_rank_0, process_start_time
from reft_ext.cluster.straggler_swap import PlannedSwap
from reft_ext.report.events import record
from reft_ext.testing import fault_point  # --inject-fault moments (no-op in production)
from reft_ext.testing.fault_observer import maybe_inject_spike
from reft_ext.testing.fault_specs import parse_spike_specs


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, token count, and the pair for logging (Megatron's)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def batch_device() -> torch.device | None:
    """Where micro-batches go: this rank's CUDA device (set before the process group in
    initialize.py), or None on a machine without CUDA (the loader's tensors are used)."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def batch_to_device(batch: dict, device: torch.device | None) -> dict:
    """The micro-batch with its tensors on ``device``; None values and anything that is
    not a tensor stay as they are, and ``device`` None returns ``batch`` itself. Pinned
    host tensors are copied asynchronously on the current stream (the caching host
    allocator keeps their memory until the copy is done); pageable ones synchronously."""
    if device is None:
        return batch
    return {k: v.to(device, non_blocking=v.is_pinned()) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def forward_step(data_iterator, model):
    """One micro-batch through one model chunk. Only chunks that embed tokens or
    compute the loss read a batch, so each rank draws exactly one batch per
    micro-batch from its iterator, in the schedule's order. The batch goes to the
    model's device; an attention mask the loader did not make (--transformer-impl
    transformer_engine) stays None and the attention builds its causal mask there."""
    module = model.module
    pre, post = module.pre_process, module.post_process
    batch = batch_to_device(next(data_iterator), batch_device()) if (pre or post) else {}
    output = model(
        batch.get("tokens") if pre else None,
        batch.get("position_ids") if pre else None,
        batch.get("attention_mask"),
        labels=batch.get("labels") if post else None,
    )
    return output, partial(loss_func, batch.get("loss_mask"))


def _reduce_losses(losses_reduced) -> dict:
    """Average the micro-batch [sum, count] pairs over the data-parallel group."""
    if not mpu.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return {}
    out = {}
    for key in losses_reduced[0]:
        val = torch.vstack([x[key].view(-1) for x in losses_reduced]).sum(dim=0)
        torch.distributed.all_reduce(val, group=mpu.get_data_parallel_group())
        out[key] = (val[0] / val[1]).item()
    return out


def _iterators_for(model, it):
    return [it] * len(model) if len(model) > 1 else it


class Trainer:
    def __init__(self, args, hooks=()):
        self.args = args
        self.hooks = list(hooks)
        self.t_process = process_start_time()
        # goodput: every second of this rank's in one category (reft_ext/report/goodput.py)
        self.goodput = GoodputTracker(args, self.t_process)
        self.marks = [("imports", time.time())]
        self.restarts = 0  # in-process restarts of this process
        children.install()  # whatever this rank forks (checkpoint writers) dies with it
        initialize_megatron(args)
        self.marks.append(("distributed init", time.time()))
        # --inject-fault: this rank's fault observer, before the health check (a phase)
        self.faults = fault_injection.install_from_args(args, torch.distributed.get_rank())
        from megatron.training import reft_integration

        # before any state is built or loaded: a node that fails leaves (or stops) the job
        if reft_integration.startup_health_check(args):
            self.marks.append(("health check", time.time()))
        from megatron.training.tokenizer import build_tokenizer

        self.tokenizer = build_tokenizer(args)
        fallback = fallbacks.summary()  # the line megatron-core's import warnings became
        if fallback:
            print_rank_0(fallback)
        if fallbacks.muted_line():  # the library notes muted instead (fallbacks.py)
            print_rank_0(fallbacks.muted_line())
        print_rank_0(format_args_table(args))
        self.timers = Timers(log_level=0, log_option="minmax")
        self.config = llama_model.transformer_config(args)
        # a replacement joining ranks that had trained: the state comes back from host
        # memory or --load, or this generation ends (_join checks which)
        self.init_skipped = inprocess_generation.replacing_trained_ranks()
        if self.init_skipped:
            self.config.perform_initialization = False
            print(f"[inprocess] rank {torch.distributed.get_rank()}: weights not "
                  f"initialised (the ranks it joins had trained: they are restored)",
                  flush=True)
        if (args.save or args.load) and not torch.cuda.is_available():
            # the checkpoint writers' fork-context Manager (checkpointing.py), forked now
            # while this process is small: forked once the model and optimizer exist,
            # their pages are copy-on-write shared with it and the first write to each
            # (REFT-load's write back, the first step) copies it (docs/reft.md)
            from megatron.training.checkpointing import _prewarm_results_queue

            _prewarm_results_queue()
        with inprocess.recording_build():  # its collectives, for in-process restarts
            model = llama_model.build_model(args, self.config)
            optimizer = llama_model.build_optimizer(args, model)
        scheduler = llama_model.build_scheduler(args, optimizer)
        from megatron.training import zeropp_integration

        # --zero-quantized-*: megatron-core's ZeRO-1 all-gather / reduce-scatter replaced
        self.zeropp = zeropp_integration.install(args)
        cfg = self.config
        cfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        # the gradient sync, timed (straggler detection: compute before it, waits in it)
        cfg.finalize_model_grads_func = self.goodput.wrap_finalize(finalize_model_grads)
        cfg.grad_scale_func = optimizer.scale_loss
        self.state = TrainingState(model, optimizer, scheduler)
        # the fresh start's state: what a rank that never stepped (nor was restored) holds,
        # bit for bit what a new process of the same flags builds, with the RNG as it was
        # here (an in-process restart that restores nothing resets a survivor to it)
        self.pristine = not self.init_skipped
        self._start_rng = TrainingState.rng_state()
        # schedule events (bubbles for HAS, the Chrome trace): only when asked for, so a
        # plain run calls megatron-core exactly as Megatron-LM does
        self.events, self.fb_kwargs, self.trace_group = \
            reft_integration.pipeline_events(args, cfg)
        self.spikes = parse_spike_specs(args.inject_spike) if args.inject_spike else []
        self.spikes_fired: set = set()
        self.skip_batches = [tuple(int(x) for x in p.split(":"))
                             for p in (args.skip_train_batches or "").split(",") if p]
        self.exit_signal = ExitSignal() if args.exit_signal_handler else None
        n_params = llama_model.num_parameters(model)
        print(f" > rank {torch.distributed.get_rank()}: (tp, pp, dp) = "
              f"({mpu.get_tensor_model_parallel_rank()}, "
              f"{mpu.get_pipeline_model_parallel_rank()}, {mpu.get_data_parallel_rank()}), "
              f"parameters on this rank: {n_params}", flush=True)
        self.marks.append(("model+optimizer", time.time()))
        self.logger = TrainLogger(args, self.state)
        self.logger.zeropp = self.zeropp
        # iteration -> loss as float.hex, kept only for --log-loss-history (the tests'
        # record of every iteration on every rank that computes the loss)
        self.losses: dict[int, str] = {}
        self._failure = None  # a generation that failed while this rank joined it
        # start-up's heap (imports, model, optimizer) is not garbage: later collections,
        # the in-process restart's among them, walk only what was made after it
        gc.freeze()
        try:
            self._join()
        except Exception as exc:  # noqa: BLE001 - a replacement's start-up: see train()
            if not inprocess.should_restart(args, exc) and hasattr(self, "reft"):
                # a refused start (a checkpoint of another layout, another run's
                # snapshots ...): the shared memory it allocated goes with it
                self.reft.release_start()
            self._failure = self._restartable(exc)
            self.goodput.failed()

    def _restartable(self, exc: Exception) -> str:
        """``exc`` as the text of a failure this rank restarts from in its own process,
        or raised again (not started by the in-process supervisor, or an error of its
        own). Only the text is kept: the traceback's frames hold the failed
        generation's objects (the session, its process groups), which must be freed."""
        if not inprocess.should_restart(self.args, exc):
            raise exc
        exc.__traceback__ = None
        return f"{type(exc).__name__}: {exc}"

    def _join(self) -> None:
        """The job-wide part of start-up after the model exists (collective, in this
        order on every rank): REFT's session and the newest state, the agreement on what
        every rank goes on with (the run id among it), the data. A fresh process and a
        survivor of an in-process restart both come through here, and every collective
        is entered by every rank whatever it kept (docs/nodes.md, the start-up audit)."""
        self.ckpt = Checkpointer(self.args) if (self.args.save or self.args.load) else None
        self.goodput.loading(True)
        self.restored = self._load()
        fault_point("join", iteration=self.state.iteration)  # --inject-fault ...@join
        self._agree_start()
        self.goodput.loading(False)
        self.init_skipped = False  # (a later generation of this process restores anew)
        self.marks.append(("load", time.time()))
        self._build_data()
        self.marks.append(("data", time.time()))

    def _load(self) -> bool:
        """Newest valid state across both tiers: host memory (REFT), then --load; False
        when neither had any."""
        from megatron.training import reft_integration

        args = self.args
        # REFT's session (a DisabledSession, doing nothing, when snapshots are off)
        self.reft = reft_integration.open_session(args, self.state, self.faults,
                                                  self.events, self.trace_group)
        self.hooks.insert(0, self.reft)
        persistent = None
        if args.load:  # every rank (the flags are the job's): one tracker, agreed
            persistent = self._agreed_tracker()
        if self.reft.recover(persistent) is not None:
            return True
        if args.load and self.ckpt.load(self.state):
            self.reft.recovered_from_checkpoint(args.load)
            return True
        if self.reft.enabled or args.load:
            print_rank_0("no saved state found (host memory or --load): starting from "
                         "scratch at iteration 0")
        return False

    def _agreed_tracker(self) -> int | None:
        """--load's tracker iteration as every rank read it (one all_gather, every rank):
        REFT-load plans with it and the persistent load's barrier follows from it, so a
        rank that read another (a directory not shared across nodes, a save racing the
        read) must not go its own way: the job stops with one line instead."""
        from megatron.training.checkpointing import CheckpointError, read_tracker

        try:  # a broken tracker stops every rank alike, after the gather
            mine = read_tracker(self.args.load) if os.path.isdir(self.args.load) else None
        except CheckpointError as exc:
            mine = f"error: {exc}"
        seen = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(seen, mine)
        broken = [m for m in seen if isinstance(m, str)]
        if broken:
            raise CheckpointError(broken[0][len("error: "):])
        if len(set(seen)) > 1:
            raise CheckpointError(f"--load {self.args.load}: the ranks read different "
                                  f"checkpoints ({sorted(set(map(str, seen)))}): it must be "
                                  f"one directory every node shares")
        return seen[0]

    def _agree_start(self) -> None:
        """What every rank goes on with, decided from facts all ranks gathered (one
        all_gather, entered by every rank of every start and rejoin), never from what one
        rank kept: its state is the job's restored one, or the fresh start's (it never
        stepped; the RNG is reset to the build's); else every rank of the generation
        leaves it (a rank that trained and has nothing to roll back to, a replacement
        whose weights were never initialised, restarts as a new process; the others in
        process). The run id is agreed here too: a survivor kept the one it named, a
        replacement has none (a restored state's, else the first rank's kept one, else
        one rank 0 makes); snapshots, flushed snapshots and checkpoints carry it."""
        from reft_ext.cluster.inprocess import PeerFailure, RestartError

        s, extra = self.state, self.state.extra
        usable = self.restored or self.pristine
        if self.restored:
            self.pristine = False  # a restored state is not the fresh one
        elif usable:  # the fresh start's state: its RNG as a new process has it here
            s.set_rng_state(self._start_rng)
        made = (uuid.uuid4().hex[:12], time.strftime("%Y-%m-%d %H:%M:%S"))
        mine = (bool(self.restored), bool(usable), extra.get("run_id"),
                extra.get("run_started"), *made)
        seen = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(seen, mine)
        stuck = [r for r, m in enumerate(seen) if not m[1]]
        if stuck:
            if not usable:
                if self.init_skipped:  # the survivors found nothing either
                    raise RestartError("nothing restored into a replacement whose weights "
                                       "were not initialised: this rank restarts as a new "
                                       "process")
                # a survivor cannot re-create a fresh model bit for bit, and its live state
                # is not the replacements' (nor whole, if the failure came inside a step)
                raise RestartError("no state to roll back to (no snapshot committed yet, "
                                   "no --load): this rank restarts as a new process")
            raise PeerFailure(f"rank(s) {stuck} have no state to go on with and restart as "
                              f"new processes: this generation ends")
        named = [m for m in seen if m[0] and m[2]] or [m for m in seen if m[2]]
        extra["run_id"], extra["run_started"] = (named[0][2], named[0][3]) if named else \
            seen[0][4:6]
        print_rank_0(f"run {extra['run_id']} (first started {extra['run_started']}), "
                     f"iteration {s.iteration}")

    def _build_data(self):
        from megatron.training.data import build_train_valid_test_data_iterators

        s = self.state
        fault_point("data", iteration=s.iteration)  # --inject-fault ...@data
        # a rejoin of an in-process restart: no collectives, the datasets kept in memory
        self.train_it, self.valid_it, _ = build_train_valid_test_data_iterators(
            self.args, self.tokenizer, s.consumed_train_samples, s.consumed_valid_samples,
            collective=not inprocess_generation.rejoining())

    # ---- one step ----------------------------------------------------------------
    def _forward_backward(self, data_iterator, forward_only: bool):
        """megatron-core's schedule for this layout (1F1B, interleaved or none)."""
        args, model = self.args, self.state.model
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=_iterators_for(model, data_iterator),
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=None,
            forward_only=forward_only,
            **self.fb_kwargs,
        )

    def train_step(self):
        args, s = self.args, self.state
        for chunk in s.model:
            chunk.zero_grad_buffer()
        s.optimizer.zero_grad()
        ev = self.events
        self._phase_iteration(s.iteration + 1)
        if ev:
            ev.step_begin(s.iteration + 1)
        self.timers("forward-backward", log_level=0).start()
        losses = self._forward_backward(self.train_it, forward_only=False)
        self.timers("forward-backward").stop()
        if ev:
            ev.step_end()
        self.goodput.switch("snapshot")  # REFT's blocking, in goodput's terms
        for hook in self.hooks:  # REFT: the snapshot in flight completes before the step
            hook.before_optimizer_step(s)
        self.goodput.switch("productive")
        fault_point("step", iteration=s.iteration + 1)  # --inject-fault (reft_ext/testing)
        self.pristine = False  # from here the state is no longer the fresh start's
        if self.spikes:
            maybe_inject_spike(self.spikes, torch.distributed.get_rank(), s.iteration + 1,
                               s.model, self.spikes_fired)
        self.goodput.optimizer_begin()
        self.timers("optimizer", log_level=0).start()
        if ev:
            ev.phase_begin("optimizer-step")
        ok, grad_norm, _ = s.optimizer.step()
        if ev:
            ev.phase_end("optimizer-step", "optimizer", iteration=s.iteration + 1)
        self.timers("optimizer").stop()
        self.goodput.optimizer_end()
        if ok:
            s.scheduler.step(increment=args.global_batch_size)
        return _reduce_losses(losses), (0 if ok else 1), grad_norm

    def _phase_iteration(self, iteration: int | None) -> None:
        """The iteration whose forward/backward/p2p phases reach the fault points
        (pipeline_events.PhaseTimers; None: evaluation, no faults)."""
        timers = getattr(self.config, "timers", None)
        if self.faults and hasattr(timers, "iteration"):
            timers.iteration = iteration

    def evaluate(self):
        args, s = self.args, self.state
        self._phase_iteration(None)
        for chunk in s.model:
            chunk.eval()
        totals = {}
        with torch.no_grad():
            for _ in range(args.eval_iters):
                losses = self._forward_backward(self.valid_it, forward_only=True)
                s.consumed_valid_samples += args.global_batch_size
                for k, v in _reduce_losses(losses).items():
                    totals[k] = totals.get(k, 0.0) + v / args.eval_iters
        for chunk in s.model:
            chunk.train()
        self.logger.validation(totals)

    # ---- the loop ----------------------------------------------------------------
    def train(self) -> TrainingState:
        """Train to the end. Under the in-process supervisor a failure anywhere in the
        job (a peer's death, a hang turned into a kill, a failed collective) ends the
        generation, and this rank restarts in its own process (megatron/training/
        inprocess.py); an error of its own still ends the process."""
        failure, self._failure = self._failure, None
        while True:
            try:
                if failure is not None:
                    inprocess.restart_in_process(self, failure)
                    self.goodput.recovered(self.state.iteration)
                    failure = None
                return self._train()
            except Exception as exc:  # noqa: BLE001 - classified by _restartable
                planned = isinstance(exc, PlannedSwap)  # a straggler's node swapped out
                failure = self._restartable(exc)
                self.goodput.failed(planned)

    def _train(self) -> TrainingState:
        args, s = self.args, self.state
        for hook in self.hooks:
            hook.on_start(s)
        self.goodput.training(s)
        first = self.restarts == 0  # the start-up split: once per process
        record("resume", iteration=s.iteration)  # every rank training again (downtime)
        trained = False
        while s.iteration < args.train_iters:
            t0 = time.time()
            self.goodput.begin_iteration(s.iteration + 1)
            self._maybe_skip_batches()
            if first:
                self.logger.startup(t0 - self.t_process, self._startup_split())
                record("startup", process_start=self.t_process, marks=self.marks)
                first = False
            loss, skipped, grad_norm = self.train_step()
            s.iteration += 1
            s.consumed_train_samples += args.global_batch_size
            s.skipped_iters += skipped
            if "lm loss" in loss:
                if args.log_loss_history:
                    self.losses[s.iteration] = float(loss["lm loss"]).hex()
                if not math.isfinite(loss["lm loss"]):
                    s.nan_iters += 1
            s.report = {"loss": loss.get("lm loss"), "grad_norm": grad_norm}
            done = s.iteration
            self.goodput.switch("snapshot")
            for hook in self.hooks:
                hook.after_step(s)
            self.goodput.switch("productive")
            if s.iteration < done:  # a loss-spike rollback (REFT) took the state back
                self.goodput.rolled_back(s.iteration)
                self._after_rollback()
                continue
            if self.ckpt:
                self.ckpt.maybe_finalize(blocking=False)
            self.logger.iteration(loss, grad_norm, skipped, time.time() - t0, self.timers)
            self.goodput.iteration_done(s, self.logger.writer)
            if "lm loss" in loss:  # one rank: when each iteration ended (downtime figures)
                record("iteration", iteration=s.iteration)
            if not trained:  # the first iteration of this (re)start is done
                inprocess.trained()
                trained = True
            if s.iteration % args.eval_interval == 0 and args.eval_iters > 0:
                with self._long_phase(), self.goodput.phase("validation"):
                    self.evaluate()
            if self._should_stop():
                break
            if self.goodput.due_swap is not None:  # --reft-replace-stragglers
                take_swap(self, self.goodput.due_swap, self.goodput.detector.named)
        self._finish()
        return s

    def _maybe_skip_batches(self) -> None:
        """--skip-train-batches ITER:N: before iteration ITER, move the data position on by
        N global batches (what a loss-spike rollback with --reft-skip-batches N does)."""
        s, gbs = self.state, self.args.global_batch_size
        for it, n in self.skip_batches:
            if it == s.iteration + 1 and n:
                first = s.consumed_train_samples
                s.consumed_train_samples += n * gbs
                print_rank_0(f"skipping {n} global batch(es) before iteration {it}: samples "
                             f"{first}-{s.consumed_train_samples - 1}")
                self._build_data()

    def _after_rollback(self) -> None:
        """The state is an older iteration's and the data position moved on: read data
        from there, forget the losses that are redone, and never leave a persistent
        checkpoint from inside the spike as the newest one."""
        s = self.state
        self.losses = {i: v for i, v in self.losses.items() if i <= s.iteration}
        self._build_data()
        if self.ckpt is not None and self.ckpt.latest is not None and \
                self.ckpt.latest > s.iteration and self.args.save:
            with self._long_phase():
                self.ckpt.replace_newer(self.state)

    def _startup_split(self) -> str:
        prev, parts = self.t_process, []
        for name, t in self.marks:
            parts.append(f"{name} {t - prev:.2f}")
            prev = t
        return ", ".join(parts)

    def _long_phase(self):
        """Checkpoint saves and validation beat nowhere and may outlast
        --reft-hang-timeout: hang detection pauses for them."""
        return self.reft.heartbeat_paused()

    def _save_unless_saved(self) -> None:
        if self.args.save and self.ckpt.latest != self.state.iteration:
            with self._long_phase(), self.goodput.phase("checkpoint"):
                self.ckpt.save(self.state)

    def _should_stop(self) -> bool:
        args, s = self.args, self.state
        if args.save_interval and s.iteration % args.save_interval == 0:
            self._save_unless_saved()
        stop = bool(args.exit_interval and s.iteration % args.exit_interval == 0)
        if self.exit_signal is not None and self.exit_signal.received_anywhere():
            print_rank_0(f"exit signal received: stopping at iteration {s.iteration}")
            stop = True
        if stop:
            self._save_unless_saved()
        return stop

    def _finish(self):
        args, s = self.args, self.state
        self.reft.pause_heartbeat()  # the final save and the shutdown: not judged
        self._save_unless_saved()
        if self.ckpt:
            self.ckpt.close()
        if args.save:
            print_rank_0(f"checkpoints are in {os.path.abspath(args.save)}")
        for hook in self.hooks:
            hook.on_exit(s)
        self.goodput.finish(s)  # every rank; rank 0: [REFT] goodput: ... (the job's)
        self.reft.write_trace()  # --reft-trace-file
        if args.log_params_hash:
            emit(f"[HASH] rank {torch.distributed.get_rank()} iteration {s.iteration} "
                 f"state {params_hash(s)}")
        if args.log_loss_history:
            if self.losses:  # every rank of the last pipeline stage
                emit(f"[LOSSES] rank {torch.distributed.get_rank()} " + " ".join(
                    f"{i}:{h}" for i, h in sorted(self.losses.items())))
        self.logger.close()


def pretrain(args, hooks=()) -> TrainingState:
    trainer = Trainer(args, hooks)
    state = trainer.train()
    torch.distributed.barrier()
    inprocess.close()
    return state
