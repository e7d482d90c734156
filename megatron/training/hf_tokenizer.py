"""The tokenizer a job trained with, written as files transformers loads (convert_checkpoint.py).

* ByteLevelTokenizer (ids 0..255 are UTF-8 bytes, 256 end-of-document, 257 padding): a
  ``tokenizers`` BPE with the 256 byte symbols (GPT-2's byte-to-unicode alphabet) and no
  merges, so every byte is its own id, plus ``<eod>`` and ``<pad>`` as special tokens; a
  ``PreTrainedTokenizerFast`` around it is saved. Encoding any text gives the trainer's ids.
* HuggingFaceTokenizer: its own files, loaded and saved again by transformers.
* SentencePieceTokenizer: the ``.model`` file's proto through transformers' SpmConverter,
  which follows the model's normalizer and merges (the trainer's ids, tested).
* NullTokenizer (mock data): no text, no tokenizer files.
"""

from __future__ import annotations

import os

from megatron.training.hf_llama import ConversionError

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


def sentencepiece_tokenizer(model_path: str):
    """A PreTrainedTokenizerFast that encodes and decodes as the trainer's
    SentencePieceTokenizer (``SentencePieceProcessor.encode``, no BOS/EOS added).

    Built from the .model's own proto by transformers' ``SpmConverter`` (its normalizer,
    dummy prefix, BPE merges ranked by score or the Unigram scores, byte fallback), not
    through ``LlamaTokenizer(vocab_file=...)``: transformers 5 builds that one's vocabulary
    from its defaults (3 entries, every text encodes to nothing)."""
    import sentencepiece
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(model_path).proto
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unigram = proto.trainer_spec.model_type == 1
    vocab = pieces if unigram else {p: i for i, (p, _) in enumerate(pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    if tok is None:
        raise ConversionError(f"--tokenizer-model {model_path}: a SentencePiece model of type "
                              f"{proto.trainer_spec.model_type} (only BPE and Unigram export)")
    spec = proto.trainer_spec  # decode an unknown piece as SentencePiece does (" ⁇ ")
    tok.decoder = decoders.Sequence([decoders.Replace(spec.unk_piece, spec.unk_surface),
                                     tok.decoder])
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    named = {name: sp.id_to_piece(i) for name, i in (("bos_token", sp.bos_id()),
             ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id()))
             if i >= 0}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    if len(fast) != sp.vocab_size() or fast.eos_token_id != sp.eos_id():
        raise ConversionError(f"--tokenizer-model {model_path}: exported {len(fast)} pieces, "
                              f"the model has {sp.vocab_size()}")
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
            raise ConversionError(f"--tokenizer-model {model_path}: the job's tokenizer is "
                                  f"not there; give its file or directory")
        tok = HuggingFaceTokenizer(model_path)._tok
    elif kind == "SentencePieceTokenizer":
        if not model_path or not os.path.isfile(model_path):
            raise ConversionError(f"--tokenizer-model {model_path}: the job's SentencePiece "
                                  f"model is not there; give its .model file")
        tok = sentencepiece_tokenizer(model_path)
    else:
        raise ConversionError(f"--tokenizer-type {kind}: no Hugging Face export for it")
    tok.save_pretrained(out)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}
