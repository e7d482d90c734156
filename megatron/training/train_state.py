"""The training state's one home: what a checkpoint or an in-memory snapshot must hold.

:class:`TrainingState` owns the model chunks, the megatron optimizer, the lr scheduler,
the counters (iteration, consumed samples, skipped iterations) and knows how to read
and write the RNG states. Persistent checkpoints (checkpointing.py) and in-memory
snapshots (reft_ext) capture exactly this object, so both resume bit-exactly.

The tensors of the state are enumerated by :meth:`TrainingState.state_tensors` in a
fixed order: model parameters, then the optimizer's main (fp32) parameters where they
are not views of model parameters, then the optimizer's state tensors (Adam's
moments, SGD's momentum buffers: optimizer_state.py).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron.training import optimizer_state


@dataclass
class TrainingState:
    model: list  # megatron DDP-wrapped model chunks (one per virtual pipeline stage)
    optimizer: Any  # megatron MegatronOptimizer / ChainedOptimizer
    scheduler: Any  # OptimizerParamScheduler
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    # small JSON-able state of the run's components that must survive a restart with
    # the rest (REFT's counters for its end-of-run summary: snapshots, recoveries)
    extra: dict = field(default_factory=dict)
    # the last step's job-wide loss and grad norm as the trainer saw them (not saved):
    # what loss-spike rollback judges (reft_ext/load/rollback.py)
    report: dict = field(default_factory=dict)

    # ---- scalars -------------------------------------------------------------
    COUNTERS = ("iteration", "consumed_train_samples", "consumed_valid_samples",
                "skipped_iters", "nan_iters")

    def counters(self) -> dict:
        return {k: int(getattr(self, k)) for k in self.COUNTERS}

    def set_counters(self, values: dict) -> None:
        for k in self.COUNTERS:
            setattr(self, k, int(values.get(k, 0)))

    # ---- RNG -----------------------------------------------------------------
    @staticmethod
    def rng_state() -> dict:
        """python, numpy, torch CPU (+CUDA) generators and megatron's TP tracker."""
        state = {
            "random": random.getstate(),
            "np_random": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in
                        tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def set_rng_state(state: dict) -> None:
        random.setstate(state["random"])
        np.random.set_state(state["np_random"])
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k: v.clone() for k, v in state["tracker"].items()})

    # ---- tensors -------------------------------------------------------------
    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor of the state, in a fixed order.

        Names are stable across restarts of the same layout. The optimizer's main
        params are listed only where they own their storage (bf16 training); with fp32
        params megatron's optimizers update views of the model params.
        """
        out = []
        model_ptrs = set()
        for i, chunk in enumerate(self.model):
            for name, p in chunk.module.named_parameters():
                out.append((f"model{i}.{name}", p.data))
                model_ptrs.add(p.data.untyped_storage().data_ptr())
        # the optimizer's state tensors as its kind keeps them (optimizer_kinds.py's
        # table): Adam's exp_avg/exp_avg_sq keep their names, SGD adds momentum_buffer
        for j, (p, st, keys) in enumerate(optimizer_state.captured_states(self.optimizer)):
            if p.data.untyped_storage().data_ptr() not in model_ptrs:
                out.append((f"optim.main{j}", p.data))
            for key in keys:
                if key in st:
                    out.append((f"optim.{key}{j}", st[key]))
        return out

    # ---- small state: everything but the tensors ------------------------------------
    def metadata(self) -> dict:
        """Counters, RNG, scheduler, optimizer step counts, loss scaler: with
        :meth:`state_tensors` this is the whole training state."""
        return {
            "counters": self.counters(),
            "rng": self.rng_state(),
            # the saved name predates other optimizers: one entry per torch optimizer
            "adam_steps": optimizer_state.optimizer_steps(self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "grad_scaler": _grad_scaler_state(self.optimizer),
            "extra": copy.deepcopy(self.extra),
        }

    def load_metadata(self, meta: dict) -> None:
        optimizer_state.ensure_state(self.optimizer)
        optimizer_state.set_optimizer_steps(self.optimizer, meta["adam_steps"])
        from megatron.training.scheduler_resume import check_resumed_schedule

        # a re-run whose flags changed the schedule: refused as for --load (before the
        # RNG and counters; the caller's error stops the start)
        check_resumed_schedule(self.scheduler, meta["scheduler"],
                               "REFT's snapshot in host memory")
        # OptimizerParamScheduler.load_state_dict *advances* by the saved step count (it
        # expects a fresh scheduler), so rewind a live one first
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(meta["scheduler"])
        _set_grad_scaler_state(self.optimizer, meta["grad_scaler"])
        self.set_counters(meta["counters"])
        self.set_rng_state(meta["rng"])
        self.extra = copy.deepcopy(meta.get("extra", {}))

    # ---- in-memory capture / restore -----------------------------------------
    def capture(self) -> dict:
        """A deep copy of the whole state (host memory), restorable with :meth:`restore`."""
        return {"tensors": [(n, t.detach().clone()) for n, t in self.state_tensors()],
                **self.metadata()}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        optimizer_state.ensure_state(self.optimizer)
        current = self.state_tensors()
        if [n for n, _ in current] != [n for n, _ in snap["tensors"]]:
            raise RuntimeError("snapshot does not match this model/optimizer layout")
        for (_, dst), (_, src) in zip(current, snap["tensors"]):
            dst.copy_(src)
        self.load_metadata(snap)


def _grad_scalers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "grad_scaler", None) is not None:
            yield opt.grad_scaler


def _grad_scaler_state(optimizer) -> list:
    return [gs.state_dict() for gs in _grad_scalers(optimizer)]


def _set_grad_scaler_state(optimizer, states: list) -> None:
    for gs, st in zip(_grad_scalers(optimizer), states):
        gs.load_state_dict(st)


def params_hash(state: TrainingState) -> str:
    """sha256 over every state tensor's bytes: equal iff bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for name, t in state.state_tensors():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
