"""The model and its layout, as the planner sees them: Llama on megatron-core's GPTModel
(local spec: RMSNorm, SwiGLU, GQA, no biases, untied embedding and output layer), split by
TP / PP / virtual PP, trained with Adam, optionally with the distributed optimizer (ZeRO-1).

Two dataclasses, :class:`ModelConfig` and :class:`ParallelConfig`; every field is a flag of
``python -m reft_ext.plan`` with Megatron's name, and ``__post_init__`` rejects bad values
with an error naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reft_ext.plan.common import fail, positive
from reft_ext.plan.common import flag_field as _f
from reft_ext.plan.presets import (
    LLAMA2_VOCAB_SIZE,
    MODEL_PRESETS,
    check_model_split,
    fill_model_shape,
)

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")


@dataclass
class ModelConfig:
    """The model's shape; ``None`` fields come from the preset, as in the trainer."""

    model_size: str | None = _f(None, "Llama preset: " + ", ".join(MODEL_PRESETS))
    num_layers: int | None = _f(None, "transformer layers (default: the preset's)")
    hidden_size: int | None = _f(None, "model width (default: the preset's)")
    num_attention_heads: int | None = _f(None, "attention heads (default: the preset's)")
    num_query_groups: int | None = _f(None, "GQA key/value groups (default: heads)")
    ffn_hidden_size: int | None = _f(None, "SwiGLU width (default: Llama's rule, 8h/3 "
                                           "rounded up to 256)")
    seq_length: int | None = _f(None, "tokens per sample (default 4096, tiny 128)")
    vocab_size: int = _f(LLAMA2_VOCAB_SIZE, "vocabulary before padding (Llama-2's)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of "
                                                "this x TP, as megatron does")
    precision: str = _f("bf16", "parameter dtype, from --bf16 / --fp16 / --fp32 (Adam "
                                "state and main params are fp32 in every case)", "")

    def __post_init__(self):
        if self.model_size is not None and self.model_size not in MODEL_PRESETS:
            fail("--model-size", f"unknown preset {self.model_size!r}; choose from "
                 f"{', '.join(sorted(MODEL_PRESETS))}")
        if self.precision not in PRECISIONS:
            fail("--bf16/--fp16", f"precision must be one of {PRECISIONS}")
        fill_model_shape(self, self.model_size, fail)
        positive(ModelConfig, self, "num_layers", "hidden_size", "num_attention_heads",
                 "num_query_groups", "ffn_hidden_size", "seq_length", "vocab_size",
                 "make_vocab_size_divisible_by")
        if self.hidden_size % self.num_attention_heads:
            fail("--num-attention-heads", f"--hidden-size {self.hidden_size} is not "
                 f"divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_query_groups:
            fail("--num-query-groups", f"{self.num_attention_heads} heads are not "
                 f"divisible by {self.num_query_groups} query groups")

    @property
    def param_bytes(self) -> int:
        """Bytes per model parameter element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's rule: a multiple of --make-vocab-size-divisible-by x TP."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def layer_shapes(self, tp: int) -> list[tuple[str, tuple[int, ...]]]:
        """One transformer layer's parameters on one TP rank, in named_parameters order."""
        h, d = self.hidden_size, self.kv_channels
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * d
        return [("input_layernorm.weight", (h,)),
                ("self_attention.linear_proj.weight", (h, self.num_attention_heads * d // tp)),
                ("self_attention.linear_qkv.weight", (qkv // tp, h)),
                ("pre_mlp_layernorm.weight", (h,)),
                ("mlp.linear_fc1.weight", (2 * self.ffn_hidden_size // tp, h)),
                ("mlp.linear_fc2.weight", (h, self.ffn_hidden_size // tp))]

    def num_parameters(self) -> int:
        """Parameters of the whole model (unpadded vocabulary, TP 1)."""
        layer = sum(math.prod(s) for _, s in self.layer_shapes(1))
        return (self.num_layers * layer + self.hidden_size
                + 2 * self.vocab_size * self.hidden_size)

    def layer_flops(self, tokens: int) -> float:
        """Forward + backward FLOPs of one layer for ``tokens`` tokens (Megatron-LM's
        model-FLOPs formula for GQA + SwiGLU, as the trainer's MFU column)."""
        h, s = self.hidden_size, self.seq_length
        gqa = self.num_query_groups / self.num_attention_heads
        return 12 * tokens * h * h * ((1 + gqa + s / h) + 1.5 * self.ffn_hidden_size / h)

    def logits_flops(self, tokens: int) -> float:
        return 6 * tokens * self.hidden_size * self.padded_vocab_size(1)


@dataclass
class ParallelConfig:
    """The layout: rank = tp + TP * (dp + DP * pp), megatron's default order tp-cp-ep-dp-pp."""

    tensor_model_parallel_size: int = _f(1, "TP: ranks sharing each layer")
    pipeline_model_parallel_size: int = _f(1, "PP: pipeline stages")
    data_parallel_size: int = _f(1, "DP: replicas; the size D of every sharding group")
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        None, "layers per model chunk: the interleaved 1F1B schedule")
    use_distributed_optimizer: bool = _f(False, "ZeRO-1: Adam state and main params "
                                                "sharded over DP (owned, not replicated)")
    micro_batch_size: int = _f(1, "samples per micro-batch")
    global_batch_size: int | None = _f(None, "samples per iteration (or give "
                                             "--num-microbatches)")
    num_microbatches: int | None = _f(None, "micro-batches per iteration (default 4 x PP)")
    gpus_per_node: int = _f(8, "ranks per node, the failure domain (consecutive ranks)")
    recompute_granularity: str = _f("selective", "activation recomputation, for the "
                                                 "device memory estimate: none, "
                                                 "selective, full")

    def __post_init__(self):
        positive(ParallelConfig, self, "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "data_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "micro_batch_size",
                 "global_batch_size", "num_microbatches", "gpus_per_node")
        if self.recompute_granularity not in RECOMPUTE:
            fail("--recompute-granularity", f"choose from {', '.join(RECOMPUTE)}")
        per_batch = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size is not None:
            if self.num_microbatches is not None and \
                    self.num_microbatches * per_batch != self.global_batch_size:
                fail("--num-microbatches", f"{self.num_microbatches} disagrees with "
                     f"--global-batch-size {self.global_batch_size}; give one of them")
            if self.global_batch_size % per_batch:
                fail("--global-batch-size", f"{self.global_batch_size} is not divisible by "
                     f"--micro-batch-size x data-parallel size = {per_batch}")
            self.num_microbatches = self.global_batch_size // per_batch
        elif self.num_microbatches is None:
            self.num_microbatches = 4 * self.pipeline_model_parallel_size
        self.global_batch_size = self.num_microbatches * per_batch
        if self.world_size % self.gpus_per_node and self.world_size > self.gpus_per_node:
            fail("--gpus-per-node", f"world size {self.world_size} is not a multiple of "
                 f"{self.gpus_per_node}")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def vpp(self, model: ModelConfig) -> int:
        per_vp = self.num_layers_per_virtual_pipeline_stage
        return 1 if per_vp is None else model.num_layers // self.pp // per_vp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a global rank."""
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def dp_groups(self) -> list[list[int]]:
        """Every sharding group (data-parallel group: same stage and TP rank)."""
        return [[self.rank(t, d, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def check(self, model: ModelConfig) -> None:
        """What the trainer's validate_args would reject for this model and layout."""
        tp, pp = self.tp, self.pp
        check_model_split(model, tp, pp, fail)
        per_vp = self.num_layers_per_virtual_pipeline_stage
        if per_vp is not None:
            per_stage = model.num_layers // pp
            if pp < 2 or per_stage % per_vp or per_stage // per_vp < 2:
                fail("--num-layers-per-virtual-pipeline-stage",
                     f"{per_vp} must divide the {per_stage} layers of a stage into >= 2 "
                     f"chunks, with PP >= 2")
            if self.num_microbatches % pp:
                fail("--num-microbatches", f"the interleaved schedule needs a multiple of "
                     f"PP {pp}, got {self.num_microbatches}")
