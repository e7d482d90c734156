"""The tokenizer a job trained with, written as files transformers loads (convert_checkpoint.py).

* ByteLevelTokenizer (ids 0..255 are UTF-8 bytes, 256 end-of-document, 257 padding): a
  ``tokenizers`` BPE with the 256 byte symbols (GPT-2's byte-to-unicode alphabet) and no
  merges, so every byte is its own id, plus ``<eod>`` and ``<pad>`` as special tokens; a
  ``PreTrainedTokenizerFast`` around it is saved. Encoding any text gives the trainer's ids.
* HuggingFaceTokenizer: its own files, loaded and saved again by transformers.
* SentencePieceTokenizer: the ``.model`` file through transformers' LlamaTokenizer.
* NullTokenizer (mock data): no text, no tokenizer files.
"""

from __future__ import annotations

import os

BYTES, EOD, PAD = 256, 256, 257


def byte_level_tokenizer():
    """A PreTrainedTokenizerFast with the trainer's ByteLevelTokenizer ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins, in no byte order
    # GPT-2's byte -> unicode table, rebuilt: bytes printable in latin-1 map to
    # themselves, the others to 256 + n in order
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(BYTES):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(BYTES + extra)
            extra += 1
    assert set(table.values()) == set(alphabet), "GPT-2 byte alphabet changed"
    vocab = {table[b]: b for b in range(BYTES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eod>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eod>", pad_token="<pad>")
    assert fast.convert_tokens_to_ids(["<eod>", "<pad>"]) == [EOD, PAD]
    return fast


def export(kind: str, model_path: str | None, out: str) -> dict:
    """Writes the tokenizer into ``out``; returns config.json's special token ids."""
    if kind == "NullTokenizer":
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if kind == "ByteLevelTokenizer":
        tok = byte_level_tokenizer()
    elif kind == "HuggingFaceTokenizer":  # the trainer's own loader: eos/pad as it found them
        from megatron.training.tokenizer import HuggingFaceTokenizer

        if not model_path or not os.path.exists(model_path):
            raise FileNotFoundError(f"--tokenizer-model {model_path}: the job's tokenizer is "
                                    f"not there; give its file or directory")
        tok = HuggingFaceTokenizer(model_path)._tok
    elif kind == "SentencePieceTokenizer":
        from transformers import LlamaTokenizer

        if not model_path or not os.path.isfile(model_path):
            raise FileNotFoundError(f"--tokenizer-model {model_path}: the job's SentencePiece "
                                    f"model is not there")
        # the trainer's SentencePiece encode adds no BOS: neither may the export
        tok = LlamaTokenizer(vocab_file=model_path, add_bos_token=False, add_eos_token=False)
    else:
        raise ValueError(f"--tokenizer-type {kind}: no Hugging Face export for it")
    tok.save_pretrained(out)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}
