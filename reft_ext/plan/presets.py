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
