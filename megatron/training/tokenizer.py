"""Tokenizers read from local files only: byte-level, Hugging Face, SentencePiece, null (mock).

`build_tokenizer(args)` is the entry point the training loop calls. It mirrors Megatron-LM's
function of the same name: it returns a tokenizer and sets `args.padded_vocab_size`.

    --tokenizer-type ByteLevelTokenizer                    (default; UTF-8 bytes, vocab 258)
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR|tokenizer.json
    --tokenizer-type SentencePieceTokenizer --tokenizer-model FILE.model
    --tokenizer-type NullTokenizer --vocab-size N          (--mock-data)

Every tokenizer satisfies what megatron-core's GPTDataset / MockGPTDataset read from one:
`vocab_size` (chooses the on-disk token dtype), `eod` (end of document; also the token the
mock dataset appends), `pad` (masked out of the loss when the dataset pads; -1 = none), and
`unique_identifiers` (hashed into the dataset index cache file names; for the file-based
tokenizers it holds the files' sha256, so another tokenizer never reuses cached indices).

A dataset records the tokenizer it was made with next to its .bin/.idx
(`<prefix>.tokenizer-info.json`, written by tools/preprocess_data.py); training checks it
against its own (megatron/training/dataset_files.py) so tokens are never read with the wrong vocabulary.
"""

import math
import os
import warnings
from collections import OrderedDict
from typing import List, Optional

from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase

from megatron.training.tokenizer_files import (  # noqa: F401 - re-exported
    FILE_TOKENIZERS,
    SUPPORTED_TOKENIZERS,
    TokenizerError,
    check_tokenizer_model,
    tokenizer_identity,
    tokenizer_model_files,
)


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
        self.identity = tokenizer_identity("ByteLevelTokenizer")

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


class _FileTokenizer(MegatronTokenizerBase):
    """What the Hugging Face and SentencePiece wrappers share: the special ids, the vocab
    views and an identity that hashes the tokenizer's files."""

    KIND = ""

    def __init__(self, path: str, library: str) -> None:
        check_tokenizer_model(self.KIND, path)
        super().__init__(path=path, config={"library": library})
        self.identity = tokenizer_identity(self.KIND, path)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{self.KIND} here is for pretraining: no chat template")

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        # the files' hash, not their path: a tokenizer edited in place gets new cache entries
        return OrderedDict(
            {"class": f"{type(self).__module__}.{type(self).__qualname__}",
             "sha256": self.identity["sha256"], "vocab_size": self.vocab_size,
             "eod": self.eod, "pad": self.pad}
        )

    def _no_eod(self, how: str):
        return TokenizerError(f"--tokenizer-model {self.path}: no end-of-document token; {how} "
                              f"(tools/train_tokenizer.py makes tokenizers that have one)")


class HuggingFaceTokenizer(_FileTokenizer):
    """A local Hugging Face tokenizer through transformers: AutoTokenizer for a directory,
    PreTrainedTokenizerFast for a bare tokenizer.json. Never downloads (local_files_only).

    Megatron-LM's semantics: tokenize(text) is tokenizer(text).input_ids, so a tokenizer that
    adds its own special tokens (Llama-3's BOS) adds them here too; eod is eos_token; vocab_size
    is len(tokenizer) (added tokens included). A bare tokenizer.json (or a directory without a
    tokenizer_config.json) names no eos/pad: they are found among its special tokens by the
    usual names.
    """

    KIND = "HuggingFaceTokenizer"
    EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<eod>", "[EOS]")
    PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")

    def __init__(self, path: str) -> None:
        super().__init__(path, "huggingface")
        import transformers

        configured = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
        try:
            if configured:  # a directory whose config names the class and the special tokens
                tok = transformers.AutoTokenizer.from_pretrained(
                    path, local_files_only=True, trust_remote_code=False)
            else:  # a tokenizer.json, or a directory holding only one
                tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path if os.path.isfile(
                    path) else os.path.join(path, "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise TokenizerError(f"--tokenizer-model {path}: transformers cannot load it "
                                 f"({type(exc).__name__}: {exc})") from None
        self._tok = tok
        self._vocab = tok.get_vocab()
        if not configured:  # eos/pad by name, set on it too: save_pretrained keeps them
            if tok.eos_token_id is None and self._named(self.EOD_NAMES) is not None:
                tok.eos_token = self._named(self.EOD_NAMES)
            if tok.pad_token_id is None and self._named(self.PAD_NAMES) is not None:
                tok.pad_token = self._named(self.PAD_NAMES)
        self._eod, pad = tok.eos_token_id, tok.pad_token_id
        if self._eod is None:
            raise self._no_eod("set eos_token in its tokenizer_config.json")
        # no pad (or pad == eos, a common Hugging Face habit): -1, megatron-core's "no padding";
        # eod must never be masked out of the loss as padding
        self._pad = -1 if pad is None or pad == self._eod else int(pad)

    def _named(self, names) -> Optional[str]:
        specials = {t.content for t in self._tok.added_tokens_decoder.values() if t.special}
        return next((n for n in names if n in specials), None)

    def tokenize(self, text: str) -> List[int]:
        # verbose=False: whole documents are longer than any context, no warning about it
        return list(self._tok.encode(text, verbose=False))

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save_pretrained(self, directory: str):
        """Write the tokenizer as a Hugging Face directory (checkpoint converters); a bare
        tokenizer.json's eos/pad found by name are written into its tokenizer_config.json."""
        return self._tok.save_pretrained(directory)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def eod(self) -> int:
        return int(self._eod)

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> Optional[int]:
        return self._tok.bos_token_id


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece .model as trained: tokenize is a plain encode (no BOS/EOS; the
    preprocessor's --append-eod ends documents), eod is the model's eos piece, pad its pad
    piece (-1 when it has none).

    Unlike Megatron-LM's tokenizer of this name, which appends <CLS>/<SEP>/<EOD>/<MASK> pieces
    beyond the model's vocabulary, the ids are the model's own, as any other SentencePiece user
    (Hugging Face's LlamaTokenizer) numbers them.
    """

    KIND = "SentencePieceTokenizer"

    def __init__(self, path: str) -> None:
        super().__init__(path, "sentencepiece")
        self._load()

    def _load(self) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        if self._sp.eos_id() < 0:
            raise self._no_eod("it was trained with eos_id=-1; train it with an eos piece")

    def __getstate__(self):  # DataLoader workers under spawn: reload the file, not the C++ object
        state = dict(self.__dict__)
        state.pop("_sp", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._load()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        n = self._sp.vocab_size()
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < n])

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def vocab(self) -> dict:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.vocab_size())}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else -1

    @property
    def bos(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None


def build_null_tokenizer(vocab_size: int):
    """megatron-core's NullTokenizer (text is space-separated ids), sized so that the
    tokenizer's `vocab_size == vocab_size` and `eod == vocab_size - 1`.

    megatron-core's NullTokenizer(n) reports vocab n+1 with eod = n; we pass n = vocab_size - 1
    so `--vocab-size N` is the (unpadded) embedding size the user asked for. MockGPTDataset draws
    ids from [0, vocab_size) and appends eod, so every id fits the embedding.
    """
    if vocab_size is None or int(vocab_size) < 2:
        raise TokenizerError("--vocab-size: NullTokenizer needs --vocab-size >= 2")
    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null"}, vocab_size=int(vocab_size) - 1
    )
    tokenizer.identity = tokenizer_identity("NullTokenizer", vocab_size=vocab_size)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Megatron's rule: pad the vocab to a multiple of divisible_by * TP size, so every tensor
    parallel shard of the embedding/output layer has the same, GEMM-friendly size."""
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128) or 1
    multiple = divisible_by * (getattr(args, "tensor_model_parallel_size", 1) or 1)
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


# (type, model files and their stat, --vocab-size) -> the tokenizer this process built: a
# tokenizer holds no state that encoding changes, and its library's import is seconds
_built: dict = {}


def _files_signature(model) -> tuple:
    """(name, size, mtime) of the tokenizer's file, or of each file of its directory: a
    tokenizer rewritten in place is built again."""
    if not model or not os.path.exists(model):
        return ()
    paths = ([os.path.join(model, n) for n in sorted(os.listdir(model))]
             if os.path.isdir(model) else [model])
    return tuple((p, st.st_size, st.st_mtime_ns) for p in paths
                 for st in [os.stat(p)])


def build_tokenizer(args):
    """Build the tokenizer named by `args.tokenizer_type` and set `args.padded_vocab_size`.

    args.tokenizer_type: "ByteLevelTokenizer" (real text, vocab 258; the default),
        "HuggingFaceTokenizer" / "SentencePieceTokenizer" (args.tokenizer_model: local files),
        or "NullTokenizer" (mock data; needs args.vocab_size).
    The tokenizer's `identity` (tokenizer_files.tokenizer_identity) is what datasets record.
    args.padded_vocab_size is set only when absent/None, like Megatron-LM, so a value restored
    from a checkpoint wins. Raises TokenizerError, naming the flag, for an unusable tokenizer.
    """
    kind = getattr(args, "tokenizer_type", None) or "ByteLevelTokenizer"
    model = getattr(args, "tokenizer_model", None)
    if kind not in SUPPORTED_TOKENIZERS:
        raise NotImplementedError(f"--tokenizer-type {kind!r} is not available (no downloads "
                                  f"here); use one of {', '.join(SUPPORTED_TOKENIZERS)}")
    check_tokenizer_model(kind, model)
    made = (kind, model, _files_signature(model), getattr(args, "vocab_size", None))
    if made in _built:  # a warm spare built it before it had a rank (training/warm.py)
        tokenizer = _built[made]
    elif kind == "NullTokenizer":
        tokenizer = build_null_tokenizer(getattr(args, "vocab_size", None))
    else:
        cls = {"ByteLevelTokenizer": ByteLevelTokenizer, "HuggingFaceTokenizer":
               HuggingFaceTokenizer, "SentencePieceTokenizer": SentencePieceTokenizer}[kind]
        tokenizer = cls(model) if kind in FILE_TOKENIZERS else cls()
        given = getattr(args, "vocab_size", None)
        if given is not None and int(given) != tokenizer.vocab_size:
            # Megatron ignores --vocab-size for file-based tokenizers; do the same, but say so.
            warnings.warn(f"--vocab-size {given} ignored: {kind} has vocab {tokenizer.vocab_size}")
    _built[made] = tokenizer
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
