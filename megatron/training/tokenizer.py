"""Tokenizers that need no download: byte-level (real text) and null (mock data).

`build_tokenizer(args)` is the entry point the training loop calls. It mirrors Megatron-LM's
function of the same name: it returns a tokenizer and sets `args.padded_vocab_size`.

Both tokenizers satisfy what megatron-core's GPTDataset / MockGPTDataset read from a tokenizer:
`vocab_size` (chooses the on-disk token dtype), `eod` (end of document; also the token the
mock dataset appends), `pad` (masked out of the loss when the dataset pads), and
`unique_identifiers` (hashed into the dataset index cache file names, so a different tokenizer
can never reuse another tokenizer's cached indices).
"""

import math
import warnings
from collections import OrderedDict
from typing import List, Optional

from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase

SUPPORTED_TOKENIZERS = ("ByteLevelTokenizer", "NullTokenizer")


class ByteLevelTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, 256 is end-of-document, 257 is padding.

    Why not megatron-core's own `ByteLevelTokenizer` (megatron.core.tokenizers.text.libraries)?
    Its defaults put EOS at id 0 (the NUL byte) and its `ids_to_text` calls `.rstrip()`, so text
    ending in whitespace does not survive a round trip. This class is lossless for any str:
    `detokenize(tokenize(s)) == s`.
    """

    NUM_BYTES = 256
    EOD_ID = 256
    PAD_ID = 257

    def __init__(self) -> None:
        # MegatronTokenizerBase stores `path` and copies `config` entries onto the object.
        super().__init__(path=None, config={"library": "byte-level"})

    # --- encoding -------------------------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        # Special ids (eod/pad) carry no bytes. errors="replace" because a model's sampled
        # output can contain byte sequences that are not valid UTF-8; valid input round-trips.
        data = bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteLevelTokenizer has no chat template")

    # --- vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + 2

    @property
    def vocab(self) -> dict:
        v = {bytes([i]).decode("latin-1"): i for i in range(self.NUM_BYTES)}
        v.update({"<eod>": self.EOD_ID, "<pad>": self.PAD_ID})
        return v

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self.EOD_ID

    @property
    def eos(self) -> int:
        return self.EOD_ID

    @property
    def pad(self) -> int:
        return self.PAD_ID

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            {"class": f"{type(self).__module__}.{type(self).__qualname__}",
             "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}
        )


def build_null_tokenizer(vocab_size: int):
    """megatron-core's NullTokenizer (text is space-separated ids), sized so that the
    tokenizer's `vocab_size == vocab_size` and `eod == vocab_size - 1`.

    megatron-core's NullTokenizer(n) reports vocab n+1 with eod = n; we pass n = vocab_size - 1
    so `--vocab-size N` is the (unpadded) embedding size the user asked for. MockGPTDataset draws
    ids from [0, vocab_size) and appends eod, so every id fits the embedding.
    """
    if vocab_size is None or int(vocab_size) < 2:
        raise ValueError("NullTokenizer needs --vocab-size >= 2")
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=int(vocab_size) - 1
    )


def vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Megatron's rule: pad the vocab to a multiple of divisible_by * TP size, so every tensor
    parallel shard of the embedding/output layer has the same, GEMM-friendly size."""
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128) or 1
    multiple = divisible_by * (getattr(args, "tensor_model_parallel_size", 1) or 1)
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def build_tokenizer(args):
    """Build the tokenizer named by `args.tokenizer_type` and set `args.padded_vocab_size`.

    args.tokenizer_type: "ByteLevelTokenizer" (real text, vocab 258) or "NullTokenizer"
        (mock data; needs args.vocab_size).
    args.padded_vocab_size is set only when absent/None, like Megatron-LM, so a value restored
    from a checkpoint wins.
    """
    kind = getattr(args, "tokenizer_type", None) or "ByteLevelTokenizer"
    if kind == "ByteLevelTokenizer":
        tokenizer = ByteLevelTokenizer()
        given = getattr(args, "vocab_size", None)
        if given is not None and int(given) != tokenizer.vocab_size:
            # Megatron ignores --vocab-size for file-based tokenizers; do the same, but say so.
            warnings.warn(
                f"--vocab-size {given} ignored: ByteLevelTokenizer has vocab {tokenizer.vocab_size}"
            )
    elif kind == "NullTokenizer":
        tokenizer = build_null_tokenizer(getattr(args, "vocab_size", None))
    else:
        raise NotImplementedError(
            f"tokenizer type {kind!r} is not available (no downloads here); "
            f"use one of {SUPPORTED_TOKENIZERS}"
        )
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
