"""What a checkpoint's recorded model shape must match in the run that loads it
(megatron/training/checkpointing.py ``_check_layout``): the shape flags beyond layers and
hidden size, and the padded vocabulary, each refused in one line naming the flag to give.
A wrong ``--rotary-base`` or ``--norm-epsilon`` loads every tensor and trains another
function without a word; a wrong ``--num-query-groups`` fails deep in dist_checkpointing.
"""

from __future__ import annotations

# model flags a checkpoint records (MODEL_FIELDS) that must equal the run's, with the
# value an absent flag means (--num-query-groups: one group per head)
SHAPE_FLAGS = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "rotary_base",
               "norm_epsilon")


def differences(saved: dict, args) -> list[tuple[str, object, object]]:
    """(field, this run's value, the checkpoint's) for each shape flag that differs."""
    def value(get, key):
        v = get(key)
        if key == "num_query_groups" and v is None:
            v = get("num_attention_heads")
        if isinstance(v, float) and v.is_integer() and key == "rotary_base":
            v = int(v)  # rope_theta 500000.0 of an import is --rotary-base 500000
        return v

    out = []
    for key in SHAPE_FLAGS:
        theirs, mine = value(saved.get, key), value(lambda k: getattr(args, k, None), key)
        if theirs is None or mine is None:  # saved before the field was recorded
            continue
        if float(theirs) != float(mine):
            out.append((key, mine, theirs))
    return out


def padding_advice(saved: dict, args) -> str:
    """Why the padded vocabularies differ and the flag that makes this run's padding the
    checkpoint's (Megatron pads to a multiple of --make-vocab-size-divisible-by x TP)."""
    have, want = args.padded_vocab_size, saved.get("padded_vocab_size")
    tp, now = args.tensor_model_parallel_size, getattr(args, "make_vocab_size_divisible_by", 128)
    head = (f"its vocabulary is padded to {want} rows, this run pads to {have} "
            f"(--make-vocab-size-divisible-by {now} x --tensor-model-parallel-size {tp})")
    vocab = saved.get("hf_vocab_size")
    if vocab is None:
        try:  # the run's tokenizer (built already: build_tokenizer caches it)
            from megatron.training.tokenizer import build_tokenizer

            vocab = build_tokenizer(args).vocab_size
        except Exception:  # noqa: BLE001 - advice only
            vocab = None
    fits = []
    if vocab and want and want % tp == 0:  # the divisors d with ceil(vocab / (d tp)) d tp == want
        fits = [d for d in range(1, want // tp + 1)
                if (want // tp) % d == 0 and -(-vocab // (d * tp)) * d * tp == want]
    if fits:
        head += f": add --make-vocab-size-divisible-by {fits[0]}"
    else:
        head += (f": no --make-vocab-size-divisible-by gives {want} rows at "
                 f"--tensor-model-parallel-size {tp}")
    if saved.get("imported_from"):
        head += (f"{' or' if fits else ';'} convert again with --target-tensor-parallel-size "
                 f"{tp}")
    return head
