"""The checks of the parsed flags: :func:`validate_args` fills derived values (data-parallel
size, micro-batches, the resolved --transformer-impl, the virtual pipeline size) and rejects
every invalid layout or flag combination with one :class:`ArgumentError` line that names
the flag and says what to do, before any process group or model exists.

Apart from the argument table (arguments.py, which re-exports these names) because the
checks are the larger half and change for other reasons: each new REFT, ZeRO++, optimizer
or device rule lands here, each new flag there. The shrink plan of the start-up health
check (startup_health_check.py) runs the same validate_args for a smaller world.
"""

from __future__ import annotations

import os

from reft_ext.plan.presets import check_model_split, fill_model_shape  # shared with the planner
from reft_ext.testing.fault_specs import (FaultSpecError, check_fault_phases, parse_fault_specs,
                                          parse_spike_specs)

from megatron.training.tokenizer_files import FILE_TOKENIZERS, tokenizer_model_error


class ArgumentError(ValueError):
    """An invalid flag value or combination; the message names the flag."""


def _fail(flag: str, msg: str):
    raise ArgumentError(f"{flag}: {msg}")


def _apply_preset(args):
    fill_model_shape(args, args.model_size or "tiny", _fail)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length


def validate_args(args, facts=None):
    """Fill derived values and reject impossible layouts with one-line errors.
    ``facts``: the machine's (megatron/training/device_facts.py; None: probed here), the
    only thing of the machine the judgement depends on."""
    from megatron.training.device_facts import DeviceFacts

    facts = DeviceFacts.probe() if facts is None else facts
    _apply_preset(args)
    tp, pp, ws = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, \
        args.world_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--micro-batch-size", args.micro_batch_size),
                    ("--train-iters", args.train_iters), ("--num-layers", args.num_layers)):
        if v < 1:
            _fail(flag, f"must be >= 1, got {v}")
    if ws % (tp * pp):
        _fail("--tensor-model-parallel-size/--pipeline-model-parallel-size",
              f"world size {ws} is not divisible by TP x PP = {tp} x {pp}")
    args.data_parallel_size = ws // (tp * pp)
    check_model_split(args, tp, pp, _fail)
    _validate_virtual_pipeline(args)
    _validate_transformer_impl(args, facts)
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        _fail("--global-batch-size", f"{args.global_batch_size} is not divisible by "
              f"--micro-batch-size x data-parallel size = {mbs} x {dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        _fail("--global-batch-size", f"the interleaved schedule needs the number of "
              f"micro-batches ({args.num_microbatches}) to be a multiple of PP {pp}")
    if args.sequence_parallel and tp == 1:
        _fail("--sequence-parallel", "needs --tensor-model-parallel-size > 1")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
        _fail("--lr-warmup-iters", f"{args.lr_warmup_iters} must be below --lr-decay-iters "
              f"({args.lr_decay_iters}, default --train-iters)")
    if args.min_lr > args.lr:
        _fail("--min-lr", f"{args.min_lr} is larger than --lr {args.lr}")
    if args.save_interval is not None and args.save_interval < 1:
        _fail("--save-interval", "must be >= 1")
    if args.save_interval and not args.save:
        _fail("--save-interval", "needs --save DIR")
    if args.async_save and not args.save:
        _fail("--async-save", "needs --save DIR")
    if args.mock_data and args.data_path:
        _fail("--mock-data", "give either --mock-data or --data-path, not both")
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        _fail("--vocab-size", "required with --tokenizer-type NullTokenizer")
    _validate_tokenizer_flags(args)
    if args.eval_interval < 1 or args.log_interval < 1:
        _fail("--eval-interval/--log-interval", "must be >= 1")
    try:  # the test machinery's parsers (reft_ext/testing/fault_specs.py)
        if args.inject_fault is not None:
            parse_fault_specs(args.inject_fault, ws)
        if args.inject_spike is not None:
            parse_spike_specs(args.inject_spike, ws)
    except FaultSpecError as exc:
        raise ArgumentError(str(exc)) from None
    for part in (args.skip_train_batches or "").split(","):
        bits = part.split(":")
        if part and not (len(bits) == 2 and all(b.isdigit() for b in bits) and int(bits[0]) >= 1):
            _fail("--skip-train-batches", f"expected ITER:N with ITER >= 1, got {part!r}")
    if args.poison_train_samples is not None:
        from megatron.training.poisoned_samples import parse_sample_ranges

        try:
            parse_sample_ranges(args.poison_train_samples)
        except ValueError as exc:
            _fail("--poison-train-samples", str(exc))
    _validate_optimizer(args)
    _validate_reft(args)
    _validate_zeropp(args)
    _validate_on_device(args, facts)
    if args.inject_fault is not None:  # a phase this run never reaches would never fire
        try:
            check_fault_phases(parse_fault_specs(args.inject_fault, ws), args)
        except FaultSpecError as exc:
            raise ArgumentError(str(exc)) from None
    return args


def _validate_tokenizer_flags(args):
    """The tokenizer flags alone (their files are checked by _check_paths)."""
    kind = args.tokenizer_type
    if (kind in FILE_TOKENIZERS) != bool(args.tokenizer_model):  # missing, or given in vain
        _fail(*tokenizer_model_error(kind, args.tokenizer_model))
    if args.tokenizer_model:  # absolute: checkpoints record it for converters run elsewhere
        args.tokenizer_model = os.path.abspath(os.path.expanduser(args.tokenizer_model))
    if kind in FILE_TOKENIZERS and not args.mock_data and not args.data_path:
        # the default data set is the shipped corpus tokenized byte by byte
        _fail("--data-path", f"required with --tokenizer-type {kind}: the default data set is "
              f"byte-level; tokenize a corpus with tools/preprocess_data.py --input "
              f"data/pd_english.jsonl.gz --output-prefix data/NAME --tokenizer-type {kind} "
              f"--tokenizer-model {args.tokenizer_model} --append-eod and give --data-path "
              f"data/NAME_text_document")


def resolve_transformer_impl(requested, te_missing):
    """--transformer-impl on this machine: ``requested`` (None: not given) and why TE
    cannot run here (``te_missing``, None when it can; llama_model.py finds it)."""
    if requested is None:
        return "local" if te_missing else "transformer_engine"
    if requested == "transformer_engine" and te_missing:
        _fail("--transformer-impl", f"transformer_engine needs TransformerEngine on a CUDA "
              f"device ({te_missing}): install it with `pip install .[gpu]` on a CUDA "
              f"machine, or give --transformer-impl local")
    return requested


def _validate_transformer_impl(args, facts):
    """Resolved and checked here, so a missing TE is one argument error, not a TypeError
    or NameError while the model is built."""
    missing = None if args.transformer_impl == "local" else facts.te_missing
    args.transformer_impl = resolve_transformer_impl(args.transformer_impl, missing)
    if args.transformer_impl != "transformer_engine":
        return
    if args.reset_attention_mask:  # TE's causal attention would ignore the document mask
        _fail("--reset-attention-mask", "per-document attention masks need --transformer-impl "
              "local (TransformerEngine's causal attention ignores the mask)")
    # TE builds the causal mask on the GPU itself: no [mbs, 1, seq, seq] mask per sample
    # made by the loader and copied to the device (data.py reads this attribute)
    args.create_attention_mask_in_dataloader = False


def rank_order(args) -> str:
    """megatron-core's rank order for this job (--use-tp-pp-dp-mapping)."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) \
        else "tp-cp-ep-dp-pp"


def _validate_optimizer(args):
    """--optimizer sgd where its state can be saved and restored: megatron-core's
    DistributedOptimizer saves Adam's param/exp_avg/exp_avg_sq only, and AOR replays
    torch's Adam."""
    if args.optimizer != "sgd":
        return
    if not 0.0 <= args.sgd_momentum < 1.0:
        _fail("--sgd-momentum", f"must be in [0, 1), got {args.sgd_momentum}")
    if "aor" in str(getattr(args, "reft_protect", "") or "").split(","):
        _fail("--reft-protect", "aor replays torch's Adam on the replica and cannot replay "
              "--optimizer sgd; drop aor or use --optimizer adam")
    if args.use_distributed_optimizer:
        _fail("--optimizer", "sgd with --use-distributed-optimizer cannot be checkpointed: "
              "megatron-core's DistributedOptimizer saves Adam's state (param, exp_avg, "
              "exp_avg_sq) only; drop --use-distributed-optimizer or use --optimizer adam")


def _validate_on_device(args, facts):
    """What only the machine decides: the optimizer megatron-core builds there (TE's or
    apex's FusedAdam/FusedSGD, else torch's) judged by REFT's table of optimizer kinds,
    one NCCL rank per device, and NCCL's error handling under an in-process restart."""
    from megatron.training.optimizer_state import BUILT_BY, kind_named

    if facts.device == "cpu":
        return
    kind = kind_named(BUILT_BY[(facts.optimizers, args.optimizer)])
    if "aor" in str(args.reft_protect or "").split(",") and kind.aor is None:
        _fail("--reft-protect", f"aor cannot replay {kind.name} (what megatron-core builds "
              f"for --optimizer {args.optimizer} with {facts.optimizers}); drop aor")
    nccl = (args.distributed_backend or "nccl") == "nccl"  # (initialize.py's default)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if nccl and per_node > facts.count:
        _fail("--nproc-per-node", f"{per_node} ranks per node, {facts.count} "
              f"{'GCD' if facts.hip else 'GPU'}(s): NCCL takes one device per rank")
    from reft_ext.cluster import inprocess

    if inprocess.enabled() and args.reft_restart == "in-process" and nccl:
        problem = inprocess.nccl_teardown_problem()
        if problem is not None:
            _fail(*problem)


def _validate_zeropp(args):
    from reft_ext.zeropp.config import ZeroPPConfig, ZeroPPConfigError

    try:
        cfg = ZeroPPConfig.from_args(args)
        cfg.validate(distributed_optimizer=bool(args.use_distributed_optimizer),
                     params_dtype="bf16" if args.bf16 else "fp32",
                     world_size=args.world_size, dp=args.data_parallel_size)
    except ZeroPPConfigError as exc:
        raise ArgumentError(str(exc)) from None
    # hpZ: megatron-core's partial distributed optimizer, one instance per partition
    args.num_distributed_optimizer_instances = cfg.instances(args.data_parallel_size)
    from reft_ext.cluster import inprocess

    if (cfg.enabled or cfg.hpz) and inprocess.enabled() and args.reft_restart == "in-process":
        # its duplicate groups are made after start-up: a restart in place destroys them
        _fail("--zero-quantized-weights/--zero-quantized-gradients",
              "not with in-process restart yet (its groups do not survive a generation); "
              "add --reft-restart process")


def _validate_reft(args):
    from reft_ext.config import ReftConfig, ReftConfigError
    from reft_ext.cluster.health_config import HealthConfig
    from reft_ext.load.rollback import RollbackConfig

    try:
        cfg = ReftConfig.from_args(args)
        health = HealthConfig.from_args(args)
        rollback = RollbackConfig.from_args(args)
        from reft_ext.cluster.straggler_config import StragglerConfig

        from reft_ext.cluster import inprocess

        swap = StragglerConfig.from_args(args).swap_problem(  # its flags' checks
            cfg, args.reft_restart == "in-process", inprocess.enabled())
        if swap:
            raise ReftConfigError(f"--reft-replace-stragglers: {swap}")
    except ReftConfigError as exc:
        raise ArgumentError(str(exc)) from None
    nodes = args.world_size // max(1, cfg.ranks_per_node)
    if health.min_nodes > nodes:
        _fail("--reft-min-nodes", f"{health.min_nodes} is more than the job's {nodes} "
              f"node(s) (--reft-ranks-per-node {cfg.ranks_per_node})")
    try:  # the library's layout checks (the snapshotter repeats them per sharding group)
        cfg.validate_parallel(args.world_size, args.data_parallel_size,
                              bool(args.use_distributed_optimizer))
        if cfg.ranks_per_node and args.world_size % cfg.ranks_per_node == 0:
            from reft_ext.protect.placement import check_placement, megatron_dp_groups

            # before any process group: the placement of megatron-core's own groups
            check_placement(cfg, args.world_size, megatron_dp_groups(
                args.world_size, args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size, order=rank_order(args)))
    except ReftConfigError as exc:
        raise ArgumentError(str(exc)) from None
    if not cfg.enabled and cfg.protect != "none":
        # the default --reft-snapshot-every 0 takes no snapshot: nothing would be protected
        _fail("--reft-protect", f"{cfg.protect} protects snapshots, and --reft-snapshot-every "
              f"{cfg.snapshot_every} takes none (REFT off): add --reft-snapshot-every N "
              f"(N >= 1) or drop --reft-protect")
    if rollback.rollback_on == "spike" and not cfg.enabled:
        _fail("--reft-rollback-on", "spike rolls back to a snapshot in host memory: it "
              "needs --reft-snapshot-every >= 1")


def _validate_virtual_pipeline(args):
    args.virtual_pipeline_model_parallel_size = None
    per_vp = args.num_layers_per_virtual_pipeline_stage
    if per_vp is None:
        return
    pp = args.pipeline_model_parallel_size
    if pp < 2:
        _fail("--num-layers-per-virtual-pipeline-stage",
              "the interleaved schedule needs --pipeline-model-parallel-size >= 2")
    per_stage = args.num_layers // pp
    if per_vp < 1 or per_stage % per_vp:
        _fail("--num-layers-per-virtual-pipeline-stage", f"{per_vp} does not divide the "
              f"{per_stage} layers of each pipeline stage")
    vpp = per_stage // per_vp
    if vpp < 2:
        _fail("--num-layers-per-virtual-pipeline-stage", f"gives one chunk per stage; use a "
              f"value below {per_stage} or drop the flag")
    args.virtual_pipeline_model_parallel_size = vpp
