"""A resumed run's learning-rate and weight-decay schedule against the one its state was
saved with, as Megatron-LM checks it (OptimizerParamScheduler.load_state_dict's
``_check_and_set``): a change of --train-iters, --lr, --min-lr, --lr-warmup-iters,
--lr-decay-iters, --lr-decay-style or --weight-decay is refused, naming the flags, unless
--override-opt_param-scheduler (this run's flags win) or
--use-checkpoint-opt_param-scheduler (the saved schedule wins). Without the check,
megatron-core takes the saved values silently and the argument table lies.

Both tiers call it before they restore anything: the persistent checkpoint
(checkpointing.py, from its common file) and host memory (train_state.load_metadata).
"""

from __future__ import annotations

from megatron.training.checkpoint_errors import CheckpointError

# (state-dict key, the flag that sets it, counted in samples: shown in iterations)
FIELDS = (
    ("max_lr", "--lr", False),
    ("min_lr", "--min-lr", False),
    ("lr_warmup_steps", "--lr-warmup-iters", True),
    ("lr_decay_steps", "--lr-decay-iters (default --train-iters)", True),
    ("lr_decay_style", "--lr-decay-style", False),
    ("start_wd", "--weight-decay", False),
    ("end_wd", "--weight-decay", False),
    ("wd_incr_steps", "--train-iters", True),
    ("wd_incr_style", "weight decay increment style", False),
)
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


class ScheduleChanged(CheckpointError):
    """The flags' schedule differs from the saved one and no flag says which wins (a
    CheckpointError: the trainer stops with its one line, exit status 3)."""


def _shown(value, in_samples: bool, gbs: int):
    if in_samples and isinstance(value, int) and gbs and value % gbs == 0:
        return value // gbs
    return value


def schedule_changes(scheduler, saved: dict) -> list[str]:
    """'FLAG HERE here, THERE there' per field the flags changed (one per flag); steps
    shown in iterations of ``scheduler.samples_per_iteration`` (llama_model.py sets it)."""
    gbs = getattr(scheduler, "samples_per_iteration", 0)
    out, named = [], set()
    for key, flag, in_samples in FIELDS:
        if key not in saved or flag in named:
            continue
        here, there = getattr(scheduler, key), saved[key]
        if here != there:
            named.add(flag)
            out.append(f"{flag} {_shown(here, in_samples, gbs)} here, "
                       f"{_shown(there, in_samples, gbs)} there")
    return out


def check_resumed_schedule(scheduler, saved: dict, where: str) -> None:
    """Raise :class:`ScheduleChanged` (naming the flags) when the schedule of this run's
    flags is not the saved one and neither scheduler flag was given. ``where``: what
    holds the saved state (a checkpoint path, host memory)."""
    changes = schedule_changes(scheduler, saved)
    if not changes:
        return
    for flag, wins in ((OVERRIDE, "this run's flags"), (USE_CHECKPOINT, "the saved values")):
        if getattr(scheduler, flag[2:].replace("-", "_"), False):
            from megatron.training.utils import print_rank_0

            print_rank_0(f"{where}: learning-rate schedule changed ({'; '.join(changes)}): "
                         f"{wins} are used ({flag})")
            return
    raise ScheduleChanged(
        f"{where}: the learning-rate schedule differs from the one it was saved with "
        f"({'; '.join(changes)}); as in Megatron-LM a resumed run keeps its schedule: "
        f"give the saved values again, or add {OVERRIDE} (this run's flags from here "
        f"on) or {USE_CHECKPOINT} (the saved schedule)")
