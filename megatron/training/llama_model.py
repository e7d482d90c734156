"""Llama on megatron-core: TransformerConfig, GPTModel chunks, DDP, optimizer, scheduler.

Llama = RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings, no biases.
--transformer-impl picks the layer spec: the local spec (torch norms, no fusions) on
CPU and wherever TransformerEngine is missing; TE's spec by default where it is installed
and CUDA is present (argument_validation.py resolves and checks the flag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig


def have_cuda() -> bool:
    return torch.cuda.is_available()


# --transformer-impl (Megatron-LM's flag): TransformerEngine's fused modules or
# megatron-core's torch modules. Both take RMSNorm from TransformerConfig.normalization;
# the TE spec of megatron-core 0.16.1 has no `normalization` parameter.
TRANSFORMER_IMPLS = ("transformer_engine", "local")
TE_SPEC_KWARGS = dict(num_experts=None, qk_layernorm=False, multi_latent_attention=False)


def transformer_engine_missing() -> str | None:
    """Why TE's layer spec cannot be built here, or None when it can. Only an
    ImportError means "not installed": any other error from TE's import is a broken
    install and is raised as it is."""
    if not have_cuda():
        return "no CUDA device here"
    from megatron.core.models.gpt import gpt_layer_specs

    if gpt_layer_specs.HAVE_TE:  # megatron-core's own TE import succeeded
        return None
    try:
        import transformer_engine  # noqa: F401 - only for the reason below
    except ImportError as exc:
        return f"TransformerEngine is not installed ({exc})"
    return "megatron-core's TransformerEngine extension (megatron.core.extensions) did not import"


def default_transformer_impl() -> str:
    """Megatron's default where TE can run, the local spec everywhere else (CPU)."""
    return "transformer_engine" if transformer_engine_missing() is None else "local"


def layer_spec(impl: str):
    """The decoder layer's ModuleSpec for --transformer-impl ``impl``."""
    if impl == "local":
        return get_gpt_layer_local_spec(normalization="RMSNorm")
    if impl != "transformer_engine":
        raise ValueError(f"--transformer-impl: {impl!r} is not one of {TRANSFORMER_IMPLS}")
    missing = transformer_engine_missing()
    if missing is not None:  # argument validation refuses this first; fail closed here too
        raise RuntimeError(f"--transformer-impl transformer_engine: {missing}; install "
                           f"TransformerEngine (pip install .[gpu]) on a CUDA machine or "
                           f"give --transformer-impl local")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(**TE_SPEC_KWARGS)


def transformer_config(args, timers=None) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    gpu = have_cuda()
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.hidden_size // args.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        # CPU: initialise on the host, no fused kernels (see docs/foundation.md)
        use_cpu_initialization=not gpu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # gloo matches same-peer messages in posting order: batched p2p swaps activations
        # with interleaved PP=2 (docs/foundation.md, trap 1)
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=True,
        # no CUDA graphs; megatron-core's default "full" means the same but warns that
        # it is deprecated on every rank
        cuda_graph_scope=[],
        timers=timers,
    )


def build_model(args, config: TransformerConfig):
    """One GPTModel per virtual pipeline chunk, wrapped in megatron DDP."""
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(args.transformer_impl),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=args.rotary_base,
            vp_stage=stage,
        )
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=getattr(
            args, "num_distributed_optimizer_instances", 1),  # hpZ (docs/zeropp.md)
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                disable_bucketing=(i > 0))
        for i, m in enumerate(chunks)
    ]


def build_optimizer(args, model_chunks):
    """megatron-core's optimizer: Adam (default) or SGD with --sgd-momentum (Megatron's
    --optimizer); REFT captures either's state (optimizer_state.py)."""
    config = OptimizerConfig(
        optimizer=getattr(args, "optimizer", "adam"),
        sgd_momentum=getattr(args, "sgd_momentum", 0.9),
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped in samples (increment = global batch size)."""
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=args.lr_decay_iters * gbs // 10 if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if args.lr_decay_style == "WSD" else None,
        # Megatron-LM's flags; neither: a resume with another schedule is refused
        # (scheduler_resume.py, before megatron-core's own assert)
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
    )
    scheduler.samples_per_iteration = gbs  # (its error names iterations, not samples)
    return scheduler


def num_parameters(model_chunks) -> int:
    return sum(p.numel() for m in model_chunks for p in m.parameters())


def num_floating_point_operations(args, batch_size: int) -> float:
    """Megatron-LM's model-FLOPs formula for a GQA + SwiGLU model (fwd + bwd)."""
    h, s, L = args.hidden_size, args.seq_length, args.num_layers
    q_ratio = 1.0  # kv_channels * heads == hidden
    gqa = args.num_query_groups / args.num_attention_heads
    return (
        12 * batch_size * s * L * h * h * (
            (1 + gqa + s / h) * q_ratio + (args.ffn_hidden_size / h) * 1.5
        )
        + 6 * batch_size * s * h * args.padded_vocab_size
    )
