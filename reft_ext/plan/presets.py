"""Model presets and the Llama width rule, shared by the trainer's ``--model-size`` and the
planner (the trainer imports them from here: reft_ext never imports the trainer)."""

from __future__ import annotations

import math

# Llama-2 family as used in the REFT paper (layers, hidden, heads, query groups), plus a
# tiny model that trains in seconds on a CPU.
MODEL_PRESETS = {
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 352, "seq_length": 128},
    "llama2-1.3b": {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 32},
    "llama2-2.7b": {"num_layers": 32, "hidden_size": 2560, "num_attention_heads": 32},
    "llama2-6.7b": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32},
    "llama2-34b": {"num_layers": 48, "hidden_size": 8192, "num_attention_heads": 64,
                   "num_query_groups": 8},
}

# Llama-2's SentencePiece vocabulary (the planner's default; the trainer takes the
# vocabulary from its tokenizer).
LLAMA2_VOCAB_SIZE = 32000


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (11008 for 4096).
    The same rule as megatron/training/arguments.py (a test keeps the two equal)."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * math.ceil(ffn / multiple_of)


def fill_model_shape(target, preset_name: str | None, fail) -> None:
    """Fill ``target``'s unset (None) shape attributes from preset ``preset_name`` and the
    Llama rules, in place: the trainer's ``--model-size`` (its args) and the planner's
    ModelConfig both resolve a model this way. ``fail(flag, message)`` raises the caller's
    error for a dimension that neither the flags nor the preset give."""
    preset = dict(MODEL_PRESETS[preset_name]) if preset_name else {}
    # values derived from the preset's width only hold for that width
    if target.hidden_size is not None:
        preset.pop("ffn_hidden_size", None)
    if target.num_attention_heads is not None:
        preset.pop("num_query_groups", None)
    for key, value in preset.items():
        if getattr(target, key) is None:
            setattr(target, key, value)
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(target, flag) is None:
            fail("--" + flag.replace("_", "-"), "required (or give --model-size)")
    if target.num_query_groups is None:
        target.num_query_groups = target.num_attention_heads
    if target.ffn_hidden_size is None:
        target.ffn_hidden_size = llama_ffn_hidden_size(target.hidden_size)
    if target.seq_length is None:  # the tiny preset sets its own (128)
        target.seq_length = 4096


def check_model_split(m, tp: int, pp: int, fail) -> None:
    """What a model's shape must satisfy to be split TP x PP, checked the same way by the
    trainer's validate_args and the planner: ``m`` has the shape attributes,
    ``fail(flag, message)`` raises the caller's error naming the flag to change."""
    if m.num_layers % pp:
        fail("--pipeline-model-parallel-size",
             f"--num-layers {m.num_layers} is not divisible by PP {pp}")
    if m.hidden_size % m.num_attention_heads:
        fail("--num-attention-heads", f"--hidden-size {m.hidden_size} is not divisible "
             f"by {m.num_attention_heads} heads")
    if m.num_attention_heads % tp:
        fail("--tensor-model-parallel-size",
             f"{m.num_attention_heads} attention heads are not divisible by TP {tp}")
    if m.num_attention_heads % m.num_query_groups:
        fail("--num-query-groups", f"{m.num_attention_heads} heads are not divisible "
             f"by {m.num_query_groups} query groups")
    if m.num_query_groups % tp:
        fail("--tensor-model-parallel-size",
             f"{m.num_query_groups} query groups are not divisible by TP {tp}")
    if m.ffn_hidden_size % tp:
        fail("--ffn-hidden-size", f"{m.ffn_hidden_size} is not divisible by TP {tp}")
