"""One training step and the loop around it: what megatron-core's schedule runs per
micro-batch, the step, evaluation, and the loop to --train-iters with its saves and exit.

forward_step (with its loss_func and the batch's move to the model's device) is what
megatron-core's pipeline schedules call for each micro-batch. TrainingLoop holds the methods
of training.Trainer that run once it is built and has joined the job (train_step, evaluate,
train and what they call); it is a mixin that reads the attributes Trainer.__init__ sets
(args, state, hooks, goodput, timers, events, logger, reft, ckpt ...) and calls its
start-up methods (_restartable, _build_data). Split out of training.py, which builds the
Trainer and brings every rank to the same starting state.
"""

from __future__ import annotations

import math
import os
import time
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.training import inprocess
from megatron.training.straggler_swap import take_swap
from megatron.training.train_state import TrainingState, params_hash
from megatron.training.utils import emit, print_rank_0
from reft_ext.cluster.straggler_swap import PlannedSwap
from reft_ext.report.events import record
from reft_ext.testing import fault_point  # --inject-fault moments (no-op in production)
from reft_ext.testing.fault_observer import maybe_inject_spike


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


class TrainingLoop:
    """The step and the loop of :class:`megatron.training.training.Trainer` (the module
    docstring says what it reads of the Trainer)."""

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
        # waiting in REFT's job-wide commit for the slowest rank: the step's grad-norm
        # all-reduce would wait as long without it (goodput_integration.py)
        self.goodput.rebook_wait(self.reft.take_peer_wait())
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
        if failure is None and self._nothing_to_train():
            return self.state
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

    def _nothing_to_train(self) -> bool:
        """A re-run of a finished job (the state it loaded is at --train-iters already):
        one line, the state saved if only host memory held it, REFT's session closed, and
        none of a run's end (no summary, no goodput: nothing ran)."""
        args, s = self.args, self.state
        if s.iteration < args.train_iters:
            return False
        past = "at" if s.iteration == args.train_iters else f"past ({s.iteration})"
        print_rank_0(f"already at --train-iters {args.train_iters}: the loaded state is "
                     f"{past} it, nothing to train. To train on, raise --train-iters (the "
                     f"learning-rate schedule was made for {args.train_iters}: add "
                     f"--override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler)")
        if self.ckpt:
            self._save_unless_saved()
            self.ckpt.close()
        torch.distributed.barrier()  # every rank done with host memory before it goes
        self.reft.close()
        if args.log_params_hash:
            emit(f"[HASH] rank {torch.distributed.get_rank()} iteration {s.iteration} "
                 f"state {params_hash(s)}")
        self.logger.close()
        return True

    def _train(self) -> TrainingState:
        args, s = self.args, self.state
        for hook in self.hooks:
            hook.on_start(s)
        self.goodput.training(s)
        self.logger.reset()  # an in-process restart: the failed generation's interval ends
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
        self.logger.reset()  # the redone iterations are counted again
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
