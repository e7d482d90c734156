"""The trainer: ``pretrain(args)`` and the Trainer it builds, megatron-core's model and
optimizers behind Megatron-LM's flags and log lines.

``pretrain(args)`` builds everything, loads ``--load`` if given, trains to
``--train-iters`` and saves. ``hooks`` are :class:`~megatron.training.hooks.TrainerHook`
objects; REFT's session (reft_ext/session.py, built in reft_integration.py) is the first
of them, and everything else REFT does for the loop is one of its methods.

This module holds the Trainer's construction and the job-wide start-up every rank goes
through, a fresh process and a survivor of an in-process restart alike (_join: the newest
state restored, what every rank goes on with agreed, the data built). The step, evaluation
and the loop itself are training_loop.py's (the TrainingLoop mixin Trainer inherits).
"""

from __future__ import annotations

import gc
import os
import time
import uuid

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.timers import Timers

from megatron.training import (children, fallbacks, fault_injection, inprocess,
                               inprocess_generation, llama_model)
from megatron.training.checkpointing import Checkpointer
from megatron.training.goodput_integration import GoodputTracker
from megatron.training.initialize import initialize_megatron
from megatron.training.arguments import format_args_table
from megatron.training.signals import ExitSignal
from megatron.training.train_log import TrainLogger
from megatron.training.train_state import TrainingState
from megatron.training.training_loop import TrainingLoop
from megatron.training.utils import print_rank_0, process_start_time
from reft_ext.testing import fault_point  # --inject-fault moments (no-op in production)
from reft_ext.testing.fault_specs import parse_spike_specs


class Trainer(TrainingLoop):
    """Built once per process; train() runs it (training_loop.py)."""

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
        from megatron.training.initialize import distributed_backend

        # the table shows what the run uses where a flag was left to its default
        backend = distributed_backend(args.distributed_backend, torch.cuda.is_available())
        print_rank_0(format_args_table(args, {"distributed_backend": backend}))
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


def pretrain(args, hooks=()) -> TrainingState:
    trainer = Trainer(args, hooks)
    state = trainer.train()
    torch.distributed.barrier()
    inprocess.close()
    # every group destroyed here, not by the interpreter's exit: gloo torn down there
    # ended a rank by SIGABRT now and then ("terminate called without an active
    # exception"), after which its launcher killed the others before their atexit
    try:
        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the run is done: say it, do not fail it
        print(f"warning: destroying the process groups at the end failed: {exc!r}",
              flush=True)
    return state
