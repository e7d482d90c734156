"""A persistent save that fails for space: one line, the state kept, no restart.

A --save filesystem that is full fails every restart's save the same way: each attempt
restored the snapshot, retrained the interval and set another incomplete ``iter_N``
aside (``.refused``, ``.refused2``: more space gone), every rank printing a traceback.
Here every rank learns (one all-reduce) whether any rank's write failed for space; then
the incomplete directory of this save is removed (no tracker names it; the last complete
checkpoint is untouched), and :class:`SaveSpaceError` says what is where: the snapshot
in host memory and the flushed tier, how much the save needs, and that the same command,
once space is freed, resumes from host memory (the job id is kept in --save:
reft_ext/cluster/run_id.py). The trainer exits with the checkpoint error status, which
the launchers do not retry (reft_ext/cluster/job_stop.py).
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _mentions_no_space(exc: BaseException | None, depth: int = 0) -> bool:
    """``exc``, its causes or (torch.distributed.checkpoint's CheckpointException) the
    failures it gathered from the ranks, an ENOSPC/EDQUOT."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, OSError) and exc.errno in _SPACE:
        return True
    if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
        return True
    for inner in getattr(exc, "failures", {}).values():  # (exception, traceback) each
        for item in inner if isinstance(inner, tuple) else (inner,):
            if isinstance(item, BaseException) and _mentions_no_space(item, depth + 1):
                return True
    return _mentions_no_space(exc.__cause__ or exc.__context__, depth + 1)


def any_rank_out_of_space(exc: BaseException) -> bool:
    """Collective (every rank's save failed, the process group is intact): whether any
    rank's failure was for space (a rank that only saw the gathered failure cannot tell)."""
    mine = torch.tensor([1 if _mentions_no_space(exc) else 0], dtype=torch.int64)
    try:
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    except RuntimeError:
        pass  # a peer is gone: this rank's own judgement
    return bool(mine.item())


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def explain(args, iteration: int, path: str, last_complete: int | None) -> str:
    """Rank 0 removes the incomplete ``path``; every rank returns the line to say."""
    from reft_ext.config import ReftConfig
    from reft_ext.store import paths

    root = args.save
    wrote = _size(path) if os.path.isdir(path) else 0
    previous = os.path.join(root, f"iter_{last_complete:07d}") if last_complete else None
    need = _size(previous) if previous and os.path.isdir(previous) else wrote
    if torch.distributed.get_rank() == 0 and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)  # incomplete, named by no tracker
    free = shutil.disk_usage(root).free
    cfg = ReftConfig.from_args(args)
    if cfg.enabled:
        kept = (f"the training state is kept in host memory ({paths.job_parent(cfg.shm_dir, cfg.job_id)}"
                f", job {cfg.job_id})" +
                (f" and, as far as the space allowed, in the flushed tier ({cfg.flush_dir})"
                 if cfg.flush_dir and cfg.flush_dir != "none" else "") +
                ": free space there and run the same command again: it resumes from host "
                "memory")
    else:
        kept = ("nothing of the iterations since the last checkpoint is kept (no REFT "
                "snapshots: --reft-snapshot-every 0): free space there and run again")
    last = f"iteration {last_complete}" if last_complete else "none"
    return (f"--save {root}: no space left for the checkpoint of iteration {iteration} "
            f"(about {_mib(need)} needed, {_mib(free)} free on its filesystem; the "
            f"incomplete {os.path.basename(path)} was removed, the last complete "
            f"checkpoint: {last}); {kept}")


def checkpoint_bytes(args) -> int | None:
    """About what one checkpoint of this model takes: every parameter once with Adam's
    two fp32 moments (and an fp32 master copy of 16-bit parameters); None when the
    shape cannot be read (the check is then skipped, not guessed)."""
    from reft_ext.plan.model import ModelConfig

    try:
        model = ModelConfig(**{k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
            "ffn_hidden_size", "seq_length", "make_vocab_size_divisible_by")},
            vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
            precision="bf16" if getattr(args, "bf16", False) else "fp32")
        extra = 8 if getattr(args, "optimizer", "adam") == "adam" else 4
        return model.num_parameters() * (model.param_bytes + extra +
                                         (4 if model.param_bytes == 2 else 0))
    except Exception:  # noqa: BLE001 (a shape the planner does not model)
        return None


def start_error(args) -> str | None:
    """Why --save's filesystem cannot hold even one checkpoint of this model, or None."""
    base = os.path.abspath(args.save)
    while not os.path.exists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    need = checkpoint_bytes(args)
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return None
    if need is None or free >= need:
        return None
    return (f"{args.save} has {_mib(free)} free on its filesystem, and one checkpoint of "
            f"this model takes about {_mib(need)}: free space there or point --save at a "
            f"larger filesystem (the first save would fail after training to it)")
