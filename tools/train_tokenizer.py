#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer (GPT-2 style) on a JSONL corpus with Hugging Face tokenizers.

    python tools/train_tokenizer.py --output tokenizers/pd_english_bpe8k      # vocab 8192
    python tools/preprocess_data.py --input data/pd_english.jsonl.gz \\
        --output-prefix data/pd_english_bpe8k --append-eod --workers 2 \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizers/pd_english_bpe8k
    torchrun ... pretrain_llama.py --data-path data/pd_english_bpe8k_text_document \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizers/pd_english_bpe8k

The output directory holds tokenizer.json (loads with tokenizers.Tokenizer.from_file) and
tokenizer_config.json + special_tokens_map.json (transformers.AutoTokenizer.from_pretrained(DIR)
gives a PreTrainedTokenizerFast). Special tokens: `<|endoftext|>` (id 0), the end-of-document
token, also eos and bos as in GPT-2, and `<|pad|>` (id 1), a pad token distinct from it so that
padding masks never hide the end of a document from the loss. Byte-level: every string
encodes (no unknown token) and decode(encode(s)) == s.

Input: plain, .gz or .xz JSONL, the --json-key field of each line (default data/pd_english.jsonl.gz,
`text`). Progress over the input's bytes goes to stderr while the corpus is read (the merges
that follow take seconds for a corpus this size); --quiet or REFT_NO_PROGRESS=1 silence it.
Only the tokenizers package is needed (pip install -e '.[hf]').
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Iterator, List, Optional

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, _REPO_ROOT)

from reft_ext.report.files import open_nofollow  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402

DEFAULT_INPUT = os.path.join(_REPO_ROOT, "data", "pd_english.jsonl.gz")
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def _open_binary_text(path: str, raw):
    """Text over the open binary file `raw`, whose tell() is the input offset reached
    (compressed bytes for .gz/.xz), so progress is known up front."""
    import gzip
    import io
    import lzma

    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw, mode="rb")
    elif path.endswith(".xz"):
        raw = lzma.LZMAFile(raw)
    return io.TextIOWrapper(raw, encoding="utf-8")


def iter_texts(path: str, key: str = "text", max_documents: Optional[int] = None,
               progress: Optional[Progress] = None) -> Iterator[str]:
    """The `key` field of each non-blank JSONL line, in order (at most max_documents)."""
    with open(path, "rb") as raw, _open_binary_text(path, raw) as lines:
        n = 0
        for lineno, line in enumerate(lines, 1):
            if progress is not None:
                progress.update(raw.tell() - progress.n)
            if max_documents is not None and n >= max_documents:
                return
            if not line.strip():
                continue
            doc = json.loads(line)
            if key not in doc:
                raise SystemExit(f"--json-key {key!r}: missing in {path} line {lineno}; "
                                 f"its keys are {sorted(doc)}")
            if doc[key]:
                n += 1
                yield doc[key]


def train_bpe(texts, vocab_size: int = 8192, min_frequency: int = 2,
              show_progress: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the strings `texts`, with
    EOD_TOKEN (id 0) and PAD_TOKEN (id 1) as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2's pre-tokenizer (its regex over bytes mapped to printable characters); no prefix
    # space, so a document's first word is not changed and decode(encode(s)) == s
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        # all 256 byte symbols, seen or not: nothing is ever unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer_dir(tok, output: str) -> List[str]:
    """Write `tok` as a Hugging Face tokenizer directory; returns the files written.

    Written by hand rather than with transformers' save_pretrained: this tool needs only the
    tokenizers package, and the class name PreTrainedTokenizerFast loads in transformers 4 and 5
    (5's own save writes TokenizersBackend, which 4 does not know)."""
    os.makedirs(output, exist_ok=True)
    specials = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        # transformers 4 would otherwise "clean up" spaces before punctuation on decode
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False,
                                      "rstrip": False, "normalized": False,
                                      "single_word": False}
            for t in (EOD_TOKEN, PAD_TOKEN)},
    }
    files = [os.path.join(output, n) for n in
             ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]
    tok.save(files[0])
    for path, doc in ((files[1], config), (files[2], specials)):
        with open_nofollow(path, encoding="utf-8") as f:  # never through a planted link
            json.dump(doc, f, indent=2)
            f.write("\n")
    return files


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a byte-level BPE tokenizer on a JSONL corpus; writes a Hugging Face "
                    "tokenizer directory (tokenizer.json + tokenizer_config.json)")
    p.add_argument("--input", default=DEFAULT_INPUT,
                   help="JSONL corpus, plain/.gz/.xz (default: the shipped "
                        "data/pd_english.jsonl.gz)")
    p.add_argument("--json-key", default="text", help="the field holding each document's text")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="directory to write (created; its tokenizer files are replaced)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="final vocabulary, 256 bytes and 2 special tokens included (default 8192)")
    p.add_argument("--min-frequency", type=int, default=2,
                   help="a pair merges only if it occurs at least this often")
    p.add_argument("--max-documents", type=int, default=None, metavar="N",
                   help="train on the first N documents only (quick trials, tests)")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary")
    a = p.parse_args(argv)
    if a.vocab_size < 258 + 1:
        p.error(f"--vocab-size {a.vocab_size}: must exceed 258 (256 bytes + 2 special tokens)")
    if not os.path.isfile(a.input):
        p.error(f"--input {a.input}: no such file")
    return a


def main(argv: Optional[List[str]] = None) -> None:
    a = get_args(argv)
    t0 = time.time()
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise SystemExit("train_tokenizer.py needs the tokenizers package: pip install -e '.[hf]'")
    size = os.path.getsize(a.input)
    with Progress(size, f"read {os.path.basename(a.input)}", unit="B", disable=a.quiet) as bar:
        texts = iter_texts(a.input, a.json_key, a.max_documents, bar)
        # tokenizers' own bars (the merges) only on a terminal: they would flood a log
        tok = train_bpe(texts, a.vocab_size, a.min_frequency,
                        show_progress=not a.quiet and sys.stderr.isatty())
        bar.update(size - bar.n)
    files = save_tokenizer_dir(tok, a.output)
    if not a.quiet:
        print(f"trained a byte-level BPE of {tok.get_vocab_size()} tokens ({EOD_TOKEN} = "
              f"{tok.token_to_id(EOD_TOKEN)}, {PAD_TOKEN} = {tok.token_to_id(PAD_TOKEN)}) on "
              f"{a.input} in {time.time() - t0:.1f} s -> {', '.join(files)}", file=sys.stderr)
        print(f"use it: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {a.output}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
