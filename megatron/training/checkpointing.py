"""Persistent checkpoints with megatron-core dist_checkpointing (torch_dist format).

Layout (Megatron-LM's): ``SAVE/iter_0000100/`` holds one checkpoint and
``SAVE/latest_checkpointed_iteration.txt`` names the newest complete one. The tracker
file is written (atomically) only after every rank has finished writing, also for
``--async-save``, so a crash during a save never points ``--load`` at a torn checkpoint,
and older checkpoints are never touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from functools import partial

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training import checkpoint_shape, optimizer_state, save_space
from megatron.training.checkpoint_errors import CheckpointError  # noqa: F401 - re-exported
from megatron.training.checkpoint_integrity import INDEX, seal_checkpoint, verify_checkpoint
from megatron.training.train_state import TrainingState
from megatron.training.utils import print_rank_0
from reft_ext.report.events import record
from reft_ext.store.atomic import write_atomic
from reft_ext.state.identity import differences, stamp
from reft_ext.testing import fault_point, get_fault_observer  # --inject-fault moments

TRACKER = "latest_checkpointed_iteration.txt"
# what makes a state a run's (reft_ext/state/identity.py): model shape, layout, optimizer
# sharding, precision, seed, data, global batch; not the DP size (an elastic shrink)
IDENTITY_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                   "ffn_hidden_size", "seq_length", "padded_vocab_size",
                   "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "use_distributed_optimizer",
                   "bf16", "seed", "data_path", "mock_data", "split", "global_batch_size")
# the model and tokenizer, beyond the identity (checkpoint args, for the HF converter)
MODEL_FIELDS = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
                "max_position_embeddings", "norm_epsilon", "rotary_base", "bf16",
                "tokenizer_type", "tokenizer_model")
CHECKPOINT_VERSION = 1
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def run_identity(args) -> dict:
    """The identity fields of this run (checkpoints carry them; REFT's snapshots add the
    protection and the failure domains)."""
    return {k: getattr(args, k, None) for k in IDENTITY_FIELDS}




def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration")
    return int(text)


def _write_tracker(root: str, iteration: int) -> None:
    # a private temporary (0600, never through a planted link), fsynced, renamed into place
    write_atomic(os.path.join(root, TRACKER), str(iteration), durable=True)


def _private_dirs(root: str, path: str) -> None:
    """--save's directory and each checkpoint's are created 0700: the state is the
    user's alone (an existing --save directory keeps the mode its owner gave it)."""
    if not os.path.isdir(root):
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)  # made meanwhile by someone else (the start checked its parent)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.path.isdir(root):
            raise CheckpointError(f"--save {root}: made by uid {st.st_uid} (mode "
                                  f"{st.st_mode & 0o7777:04o}) after the start's check, not by "
                                  f"this job: not written; remove it or choose another --save")
    os.makedirs(path, mode=0o700, exist_ok=True)


def _keep_aside(path: str) -> None:
    """A directory already at this save's path (a checkpoint --load refused, or a save
    that never finished) is renamed aside, not overwritten, so it stays for inspection;
    loads ignore the new name (only iter_NNNNNNN is a checkpoint)."""
    if not os.path.isdir(path) or not os.listdir(path):
        return
    aside, n = f"{path}.refused", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.refused{n}"
    os.rename(path, aside)
    print(f"[REFT] kept {path} aside as {aside} (it did not verify or was incomplete; "
          f"delete it when done): this save writes the iteration anew", flush=True)
    record("checkpoint_kept_aside", path=path, aside=aside)


def _faulty_write(write, iteration: int, *args, **kwargs):
    """An async save's write (run in its forked writer process, which dies with the
    rank: megatron/training/children.py) behind the fault point ``save-async``: a fault
    there kills the writer before it writes, the rank lives on and must find the save
    failed (no tracker naming the unfinished checkpoint)."""
    fault_point("save-async", iteration=iteration)
    return write(*args, **kwargs)


def _prewarm_results_queue() -> None:
    """dist_checkpointing's writer results queue uses a spawn-context Manager whose
    start re-imports ``__main__`` (torch and megatron: seconds, paid by the first save).
    A fork-context Manager serves the same queue without any import."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("fork"))  # dies with the rank (children.py)
        manager.start()
        fa._results_queue = manager.Queue()


def sharded_state_dict(state: TrainingState, args, *, is_loading: bool, load_optim=True,
                       load_rng=True, saved_dp: int | None = None) -> dict:
    """The dist_checkpointing state dict of the whole training state. ``saved_dp``: the
    data-parallel size the checkpoint was saved with, when loading into another one."""
    sd = {"checkpoint_version": CHECKPOINT_VERSION}
    model_sd = {}
    for i, chunk in enumerate(state.model):
        key = "model" if len(state.model) == 1 else f"model{i}"
        # nested by chunk, as megatron-core expects: the chunks of an interleaved pipeline
        # share their local key names, so one flat dict would keep the last chunk's
        # params only and the optimizer could not map the others ("Param id N does not
        # match any model sharded param")
        sd[key] = model_sd[key] = chunk.module.sharded_state_dict()
    if load_optim:
        if is_loading:
            optimizer_state.ensure_state(state.optimizer)  # upstream bug 1 (+ SGD momentum)
            optimizer_state.fill_missing_init_state_fn(state.optimizer)  # bug 4 (SGD)
        # bf16/fp16 without the distributed optimizer: the fp32 RMSNorm weights' state
        # ("Param id N does not match any model sharded param"), upstream bug 5
        optimizer_state.fix_float16_sharded_state_dict(state.optimizer)
        sd["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
        sd["adam_steps"] = _per_rank_object("adam_steps",
                                            optimizer_state.optimizer_steps(state.optimizer),
                                            saved_dp)
    if load_rng:
        # every rank's own generators: exact resume needs them even where DP ranks differ
        sd["rng_state"] = _per_rank_object("rng_state", state.rng_state(), saved_dp)
    sd["train_state"] = {**state.counters(), "extra": json.dumps(state.extra)}
    if not is_loading:  # read back from common.pt before the load (Checkpointer.load)
        sd["identity"] = stamp(run_identity(args))
    sd["args"] = {"tensor_model_parallel_size": args.tensor_model_parallel_size,
                  "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                  "num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "padded_vocab_size": args.padded_vocab_size,
                  "data_parallel_size": args.data_parallel_size,
                  # what tools/convert_checkpoint.py needs to rebuild the model and its
                  # tokenizer without the job's command line
                  **{k: getattr(args, k, None) for k in MODEL_FIELDS}}
    return sd


def _per_rank_object(key: str, obj, saved_dp: int | None = None) -> ShardedObject:
    """An object saved and loaded by each rank for itself. Loaded into another
    data-parallel size (an elastic shrink), data-parallel rank d reads the one of saved
    rank d mod saved_dp: replicas share the Adam step, and the RNG streams of a new
    layout cannot match the old ones anyway."""
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    if saved_dp and saved_dp != dp:
        dp, dp_rank = saved_dp, dp_rank % saved_dp
    return ShardedObject(
        key, obj,
        (mpu.get_pipeline_model_parallel_world_size(),
         mpu.get_tensor_model_parallel_world_size(), dp),
        (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
         dp_rank),
        replica_id=0)


class Checkpointer:
    """Save and load the training state; owns the async-save queue."""

    def __init__(self, args):
        self.args = args
        self.latest: int | None = None  # iteration of the last save or load: never saved twice
        self.async_queue = AsyncCallsQueue() if args.async_save else None
        if not torch.cuda.is_available():
            _prewarm_results_queue()

    # ---- save ------------------------------------------------------------------
    def save(self, state: TrainingState) -> None:
        args, it = self.args, state.iteration
        self.latest = it
        root = args.save
        path = checkpoint_dir(root, it)
        t0 = time.time()
        fault_point("save", iteration=it)  # --inject-fault ...@save (reft_ext/testing)
        if torch.distributed.get_rank() == 0:
            _keep_aside(path)
            _private_dirs(root, path)
        torch.distributed.barrier()
        sd = sharded_state_dict(state, args, is_loading=False)
        try:
            request = dist_checkpointing.save(
                sd, path, async_sharded_save=bool(self.async_queue),
                content_metadata=OPTIM_METADATA)
        except (Exception, CheckpointException) as exc:  # a full disk: said once (save_space.py)
            if not save_space.any_rank_out_of_space(exc):
                raise
            raise CheckpointError(save_space.explain(args, it, path, read_tracker(root))) \
                from None
        if self.async_queue is not None and request.async_fn is not None and \
                get_fault_observer() is not None:  # ...@save-async: in the writer process
            request = request._replace(async_fn=partial(_faulty_write, request.async_fn, it))

        def finalize():
            seal_checkpoint(path, it)  # every file's checksum, before the tracker names it
            fault_point("save-tracker", iteration=it)  # files written, tracker not yet
            if torch.distributed.get_rank() == 0:
                _write_tracker(root, it)
            print_rank_0(f"saved checkpoint at iteration {it:7d} to {path} "
                         f"[{time.time() - t0:.2f} s]")
            fault_point("save-done", iteration=it)

        if self.async_queue is None:
            torch.distributed.barrier()
            finalize()
        else:
            request.add_finalize_fn(finalize)
            self.async_queue.schedule_async_request(request)
            print_rank_0(f"scheduled async save at iteration {it:7d} "
                         f"(blocked {time.time() - t0:.2f} s)")

    def replace_newer(self, state: TrainingState) -> None:
        """After a loss-spike rollback to ``state.iteration``: checkpoints newer than it
        hold state from inside the spike. Make the rolled-back state the newest
        checkpoint first (save it, or point the tracker at its existing directory), and
        only then remove the newer ones: there is always a complete checkpoint."""
        self.maybe_finalize(blocking=True)
        root, it = self.args.save, state.iteration
        if os.path.isfile(os.path.join(checkpoint_dir(root, it), INDEX)):  # a finished save
            if torch.distributed.get_rank() == 0:
                _write_tracker(root, it)
            self.latest = it
        else:
            self.save(state)
            self.maybe_finalize(blocking=True)
        removed = []
        if torch.distributed.get_rank() == 0:
            for name in sorted(os.listdir(root)):
                m = re.fullmatch(r"iter_(\d+)", name)
                if m and int(m.group(1)) > it:
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                    removed.append(name)
        torch.distributed.barrier()
        if removed:
            print_rank_0(f"removed persistent checkpoint(s) {', '.join(removed)} of {root}: "
                         f"newer than the rollback to iteration {it}, from inside the spike")

    def maybe_finalize(self, blocking: bool = False) -> None:
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True)
            self.async_queue.close()

    # ---- load ------------------------------------------------------------------
    def load(self, state: TrainingState) -> bool:
        """Load ``--load`` into ``state``. False when there is nothing to load yet
        (no tracker: a fresh start); :class:`CheckpointError` for a broken checkpoint."""
        args = self.args
        root = args.load
        if not os.path.isdir(root):
            if args.save and os.path.abspath(args.save) == os.path.abspath(root):
                # `--save D --load D` is how a job resumes itself; its first start has no D
                print_rank_0(f"--load {root} does not exist yet (same as --save): "
                             f"starting from scratch")
                return False
            raise CheckpointError(f"--load {root}: no such directory")
        it = read_tracker(root)
        if it is None:
            print_rank_0(f"no {TRACKER} in {root}: starting from scratch")
            return False
        path = checkpoint_dir(root, it)
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "metadata.json")):
            raise CheckpointError(f"--load {root}: {TRACKER} names iteration {it} but "
                                  f"{path} is missing or incomplete")
        it = self._newest_verified(root, it)
        path = checkpoint_dir(root, it)
        # timed as REFT-load times itself (reft_ext/load/recover.py): after a barrier, so the
        # ranks' arrival skew is not counted, and reported as the slowest rank's time
        torch.distributed.barrier()
        t0 = time.perf_counter()
        load_optim, load_rng = not args.no_load_optim, not args.no_load_rng
        finetune = bool(getattr(args, "finetune", False))
        if finetune:  # Megatron's --finetune: the weights only, at any TP/PP
            load_optim = load_rng = False
        try:  # the layout first, from the small common file: a clear error, no big reads
            common = dist_checkpointing.load_common_state_dict(path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            raise CheckpointError(f"--load {root}: cannot read {path}/common.pt: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self._check_layout(common.get("args", {}), path, finetune)
        if load_optim and "opt_param_scheduler" in common:  # another schedule: refused
            from megatron.training.scheduler_resume import check_resumed_schedule

            check_resumed_schedule(state.scheduler, common["opt_param_scheduler"],
                                   f"--load {path}")
        if not finetune:
            self._warn_other_run(common, path)
        saved_dp = common.get("args", {}).get("data_parallel_size", args.data_parallel_size)
        if finetune:
            saved_dp = args.data_parallel_size  # nothing per data-parallel rank is read
        if saved_dp != args.data_parallel_size:  # megatron-core reshards params, and the
            # distributed optimizer's dp_reshardable format, in the DP dimension
            print_rank_0(f"resharding checkpoint {path} from data-parallel size {saved_dp} "
                         f"to {args.data_parallel_size}")
        with torch.no_grad():  # upstream bug 2
            sd = sharded_state_dict(state, args, is_loading=True, load_optim=load_optim,
                                    load_rng=load_rng, saved_dp=saved_dp)
            if finetune:  # a fresh run from these weights: iteration 0, its own counters
                sd.pop("train_state")
            try:
                # into a smaller DP nobody reads the per-rank objects of the dropped DP
                # ranks, which the access check would take for a hole in the checkpoint
                loaded = dist_checkpointing.load(
                    sd, path, validate_access_integrity=saved_dp == args.data_parallel_size)
            # torch DCP raises CheckpointException, a BaseException
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                raise CheckpointError(f"--load {root}: cannot read checkpoint {path}: "
                                      f"{type(exc).__name__}: {str(exc)[:500]}") from exc
            for i, chunk in enumerate(state.model):
                key = "model" if len(state.model) == 1 else f"model{i}"
                chunk.module.load_state_dict(loaded[key], strict=True)
            if load_optim:
                # into the tensors REFT's snapshot layout already holds
                optimizer_state.load_state_dict_in_place(state.optimizer, loaded["optimizer"])
                optimizer_state.set_optimizer_steps(state.optimizer, loaded["adam_steps"])  # bug 3
                # upstream bug 6: OptimizerParamScheduler.load_state_dict *adds* the
                # saved step count (step(increment=num_steps)), right only for a fresh
                # scheduler; a survivor of an in-process restart has stepped already
                state.scheduler.num_steps = 0
                state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if load_rng:
            state.set_rng_state(loaded["rng_state"])
        if not finetune:
            state.set_counters(loaded["train_state"])
            state.extra = json.loads(loaded["train_state"].get("extra", "{}"))
        self.latest = state.iteration
        secs = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(secs, op=torch.distributed.ReduceOp.MAX)
        print_rank_0(f"loaded checkpoint {path} at iteration {it}"
                     f"{' (weights only, --finetune: iteration 0, fresh optimizer)' if finetune else ''} "
                     f"[{secs.item():.3f} s, slowest rank]")
        return True

    def _newest_verified(self, root: str, newest: int) -> int:
        """The iteration to load: the tracker's when every file of it matches its
        checksum (checkpoint_integrity.py), else the newest older one that does, said in
        a line naming what failed. No verified checkpoint at all: CheckpointError."""
        older = sorted((int(m.group(1)) for m in map(
            lambda n: re.fullmatch(r"iter_(\d+)", n), os.listdir(root)) if m), reverse=True)
        refused = []
        for it in [newest] + [i for i in older if i < newest]:
            path = checkpoint_dir(root, it)
            problems = verify_checkpoint(path)  # collective: every rank gets the same list
            if not problems:
                if refused:
                    print_rank_0(f"loading {path} instead: the newest older checkpoint in "
                                 f"{root} whose files all match their checksums "
                                 f"({TRACKER} still names iteration {newest})")
                return it
            refused.append(path)
            shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)"
                                               if len(problems) > 3 else "")
            print_rank_0(f"[REFT] warning: checkpoint {path} refused: {shown}")
            record("checkpoint_refused", path=path, iteration=it, problems=problems)
        raise CheckpointError(f"--load {root}: no checkpoint there verifies (refused: "
                              f"{', '.join(refused)}); each failure is named above. Restore "
                              f"the files from a copy or start without --load")

    def _warn_other_run(self, common: dict, path: str) -> None:
        """A checkpoint saved by a run of other settings (seed, data, batch...) is loaded
        as asked (fine-tuning or changing a run from a checkpoint is normal Megatron use),
        but said in one line. Checkpoints saved before identities existed: no line."""
        saved = common.get("identity")
        mine = run_identity(self.args)
        if not saved or saved.get("fingerprint") == stamp(mine)["fingerprint"]:
            return
        try:
            run = json.loads(common["train_state"]["extra"]).get("run_id")
        except (KeyError, TypeError, ValueError):
            run = None
        diff = differences(mine, saved.get("fields", {}))
        print_rank_0(f"[REFT] warning: --load {path} was saved by "
                     f"{f'run {run}' if run else 'a run'} of other settings ("
                     f"{'; '.join(diff) if diff else 'another fingerprint'}): loading it "
                     f"as asked")
        record("identity_mismatch", path=path, run=run, differences=diff)

    def _check_layout(self, saved: dict, path: str, finetune: bool = False) -> None:
        a = self.args
        if saved.get("imported_from") and not finetune:
            raise CheckpointError(f"--load {path}: converted from {saved['imported_from']} "
                                  f"(weights only, no optimizer or data position): add "
                                  f"--finetune to train from it")
        # the weights alone reshard to any TP/PP (dist_checkpointing); the optimizer's
        # ZeRO-1 shards and the per-rank RNG states do not
        layout = () if finetune else ("tensor_model_parallel_size",
                                      "pipeline_model_parallel_size")
        for key in layout + ("num_layers", "hidden_size"):
            if saved.get(key) != getattr(a, key):
                raise CheckpointError(f"--load {path}: saved with --{key.replace('_', '-')} "
                                      f"{saved.get(key)}, this run has {getattr(a, key)}")
        # the rest of the model's shape, where the checkpoint records it (MODEL_FIELDS):
        # a wrong value would load and train another function without a word
        diffs = checkpoint_shape.differences(saved, a)
        if diffs:
            flags = [(f"--{k.replace('_', '-')}", mine, theirs) for k, mine, theirs in diffs]
            raise CheckpointError(
                f"--load {path}: saved with " + ", ".join(f"{f} {t}" for f, _, t in flags)
                + "; this run has " + ", ".join(f"{f} {m}" for f, m, _ in flags)
                + ": give " + " ".join(f"{f} {t}" for f, _, t in flags))
        if saved.get("padded_vocab_size") != a.padded_vocab_size:
            raise CheckpointError(f"--load {path}: {checkpoint_shape.padding_advice(saved, a)}")
