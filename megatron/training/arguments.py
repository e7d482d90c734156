"""Command-line arguments with Megatron-LM's flag names, Llama presets and validation.

Every invalid layout or flag combination is rejected by :func:`validate_args` with one
line that names the flag and says what to do, before any process group or model exists.

This module holds the argument table (the flags in Megatron-LM's groups, plus the
library's generated from its configs), :func:`parse_args`, the check of the paths a start
reads and writes, and Megatron's start-up table. The checks themselves are
argument_validation.py's; its names (validate_args, ArgumentError, rank_order,
resolve_transformer_impl) are imported here, so ``megatron.training.arguments`` stays the
one place importers take them from.
"""

from __future__ import annotations

import argparse
import os

from reft_ext.plan.presets import (  # shared with the planner
    MODEL_PRESETS,
    fill_model_shape,  # noqa: F401 - re-exported: one resolution of --model-size
)
from reft_ext.testing.fault_specs import GRAMMAR, PHASES

from megatron.training.argument_validation import (  # noqa: F401 - re-exported
    ArgumentError,
    _fail,
    rank_order,
    resolve_transformer_impl,
    validate_args,
)
from megatron.training.tokenizer_files import (SUPPORTED_TOKENIZERS, TokenizerError,
                                               identity_from_args, tokenizer_model_error)


def _check_paths(args) -> None:
    """The places a start reads and writes: megatron/training/path_checks.py; before them the
    tokenizer's files, after them that the data sets were made with this tokenizer."""
    from megatron.training.path_checks import check_paths

    bad = tokenizer_model_error(args.tokenizer_type, args.tokenizer_model)
    if bad:
        _fail(*bad)
    check_paths(args, _fail)
    if args.data_path and not args.mock_data:
        from megatron.training.dataset_files import data_path_prefixes, dataset_tokenizer_error

        try:
            why = dataset_tokenizer_error(data_path_prefixes(args.data_path),
                                          identity_from_args(args), args.tokenizer_model)
        except TokenizerError as exc:  # an unreadable tokenizer record
            raise ArgumentError(str(exc)) from None
        if why:
            _fail("--data-path", why)


def _add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--model-size", choices=sorted(MODEL_PRESETS), default=None,
                   help="Llama preset; explicit shape flags override its fields")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="grouped-query attention groups (default: heads, i.e. MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="SwiGLU width (default: Llama's rule from hidden size)")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default=None,
                   help="layer implementation (Megatron-LM's flag): TransformerEngine's "
                        "modules or megatron-core's torch modules; default transformer_engine "
                        "where TransformerEngine imports and CUDA is present, else local")


def _add_parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp: pipeline "
                        "stages are neighbours (inside a node), data-parallel replicas "
                        "far apart (across nodes)"),
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard optimizer state across data-parallel ranks")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=3e-5)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train-iters")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"], default="cosine")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, this run's --lr/--min-lr/--lr-warmup-iters/"
                        "--lr-decay-iters/--lr-decay-style/--weight-decay/--train-iters "
                        "replace the saved schedule's (refused without one of these two)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, keep the saved learning-rate schedule whatever those "
                        "flags say")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="megatron-core's optimizer (sgd: momentum SGD, non-distributed "
                        "optimizer only)")
    g.add_argument("--sgd-momentum", type=float, default=0.9,
                   help="momentum factor of --optimizer sgd")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving if --save) when iteration %% N == 0")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: save a checkpoint and exit cleanly")


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device, for the MFU column")
    g.add_argument("--log-params-hash", action="store_true",
                   help="print a hash of parameters and optimizer state at the end (tests)")
    g.add_argument("--log-loss-history", action="store_true",
                   help="print every iteration's loss (float.hex) at the end (tests)")


def _add_data_args(p):
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--tokenizer-type", choices=list(SUPPORTED_TOKENIZERS),
                   default="ByteLevelTokenizer",
                   help="ByteLevelTokenizer: UTF-8 bytes (vocab 258); HuggingFaceTokenizer / "
                        "SentencePieceTokenizer: the files of --tokenizer-model; "
                        "NullTokenizer: --mock-data with --vocab-size")
    g.add_argument("--tokenizer-model", type=str, default=None, metavar="PATH",
                   help="HuggingFaceTokenizer: a tokenizer.json file or a tokenizer directory; "
                        "SentencePieceTokenizer: a .model file. Local files only, never a "
                        "download (tools/train_tokenizer.py trains one)")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load the model weights of --load only (any TP/PP, e.g. one "
                        "converted from Hugging Face): fresh optimizer, iteration 0")
    g.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    g.add_argument("--trust-shared-checkpoint-dir", action="store_true",
                   help="use a --save/--load directory that other users can write (or that "
                        "lies below one): refused without this flag, since whoever can "
                        "write there can plant a checkpoint that runs code as you when it "
                        "is loaded; only for a directory shared on purpose with users you "
                        "trust")
    g.add_argument("--inject-fault", type=str, default=None, metavar=GRAMMAR + "[,...]",
                   help="tests and demos: send SIGNAL (default SIGKILL) to RANK during "
                        "iteration ITER at moment PHASE (default step: right before the "
                        "optimizer step) on torchrun attempt ATTEMPT (default 0), once per "
                        "process; MODE node|snapshot|shm-full|corrupt[-replica|-manifest|"
                        "-committed] adds REFT damage; RANK:ITER:CONT:slow:F makes RANK F "
                        "times slower from ITER (a straggler). Phases: " + ", ".join(PHASES) +
                        " (reft_ext/testing/fault_specs.py)")
    g.add_argument("--inject-spike", type=str, default=None, metavar="RANK:ITER[:scale|nan]",
                   help="tests: before ITER's optimizer step, multiply RANK's gradients by "
                        "1e4 (scale) or make them NaN (nan), once per process")
    g.add_argument("--skip-train-batches", type=str, default=None, metavar="ITER:N[,...]",
                   help="before iteration ITER, skip N global batches of training data "
                        "(what a rollback with --reft-skip-batches N does; a reference run)")
    g.add_argument("--poison-train-samples", type=str, default=None,
                   metavar="FIRST-LAST[,...]",
                   help="tests: training samples FIRST..LAST have NaN in their loss mask, "
                        "as a corrupt sample would: every pass over them gives a NaN loss "
                        "(a spike that follows the data, not the iteration)")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Llama pretraining on megatron-core",
                                allow_abbrev=False)
    for add in (_add_model_args, _add_parallel_args, _add_training_args, _add_logging_args,
                _add_data_args, _add_checkpoint_args):
        add(p)
    from reft_ext.config import ReftConfig

    ReftConfig.add_arguments(p)
    from reft_ext.load.rollback import RollbackConfig

    RollbackConfig.add_arguments(p)
    from reft_ext.cluster.health_config import HealthConfig

    HealthConfig.add_arguments(p)
    from reft_ext.cluster.straggler_config import StragglerConfig

    StragglerConfig.add_arguments(p)
    from reft_ext.zeropp.config import ZeroPPConfig

    ZeroPPConfig.add_arguments(p)
    if extra_args_provider is not None:
        extra_args_provider(p)
    return p


def parse_args(argv=None, extra_args_provider=None, world_size=None, facts=None):
    args = build_parser(extra_args_provider).parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    validate_args(args, facts)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler", "and --use-checkpoint-opt_param-scheduler "
              "exclude each other (this run's schedule, or the saved one): give one")
    _check_paths(args)
    return args


def resolved_defaults(args) -> dict:
    """What the run uses where a flag was left to its default (None): the shipped corpus
    data.py trains on (the backend: the trainer passes the one initialize.py picked).
    Shown in the table (as Megatron-LM's holds the values it set), not written back into
    ``args``: the data path is part of a checkpoint's identity (checkpointing.py)."""
    out = {}
    per_split = any(getattr(args, f"{s}_data_path", None) for s in ("train", "valid", "test"))
    if "data_path" in vars(args) and args.data_path is None and \
            not getattr(args, "mock_data", False) and not per_split:
        from megatron.training.dataset_files import DEFAULT_DATA_PREFIX

        out["data_path"] = [DEFAULT_DATA_PREFIX]
    return out


def format_args_table(args, resolved: dict | None = None) -> str:
    """Megatron's start-up table: one dotted line per argument, with the value the run
    uses (:func:`resolved_defaults`, and ``resolved``: the caller's)."""
    used = {**vars(args), **resolved_defaults(args), **(resolved or {})}
    lines = ["------------------------ arguments ------------------------"]
    for key in sorted(used):
        dots = "." * max(2, 48 - len(key))
        lines.append(f"  {key} {dots} {used[key]}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
