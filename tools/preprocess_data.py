#!/usr/bin/env python3
"""Tokenize a JSONL corpus into megatron-core's indexed dataset format (.bin + .idx).

    python tools/preprocess_data.py --input data/pd_english.jsonl.gz \
        --output-prefix data/pd_english --tokenizer-type ByteLevelTokenizer --append-eod

writes data/pd_english_text_document.{bin,idx} (Megatron-LM naming: `<prefix>_<key>_document`;
a prefix that already ends in `_text_document` is used as is). Pass the resulting prefix to
training as `--data-path data/pd_english_text_document`, with the same tokenizer flags:

    python tools/preprocess_data.py --input data/pd_english.jsonl.gz --append-eod --workers 2 \
        --output-prefix data/pd_english_bpe8k --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model tokenizers/pd_english_bpe8k     # a directory or a tokenizer.json
    ... --tokenizer-type SentencePieceTokenizer --tokenizer-model llama/tokenizer.model

Next to each .bin/.idx it records the tokenizer (`<prefix>.tokenizer-info.json`: type, model
path, the sha256 of its files, vocab size, eod/pad); training refuses a dataset whose record
names another tokenizer than its own (megatron/training/data.py).

Flags follow Megatron-LM's tools/preprocess_data.py (--input, --output-prefix, --json-keys,
--tokenizer-type, --tokenizer-model, --vocab-size, --append-eod, --workers, --log-interval).
--workers N tokenizes in N processes; the output is byte-identical to --workers 1. Input may
be plain, gzip (.gz) or xz (.xz) compressed JSONL, one {"text": ...} object per line. Documents
are written in input order; one document is one sequence (no sentence splitting). Empty
documents are skipped (a zero-length sequence is useless to GPTDataset).

The writing goes through megatron-core's IndexedDatasetBuilder, so the files are exactly what
megatron.core.datasets.indexed_dataset.IndexedDataset reads. Outputs are written under temporary
names and renamed into place, so a reader never sees a half-written .bin/.idx pair.

Progress goes to stderr (reft_ext.report.progress): bytes of the input file (compressed bytes for
.gz/.xz, known up front) with rate and ETA, redrawn in place on a terminal, else a line every
10 s (REFT_PROGRESS_EVERY_S) and a final one; REFT_NO_PROGRESS=1 or --quiet turns it off.
"""

import argparse
import gzip
import io
import json
import lzma
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# Runnable as a script from anywhere: the repo root (parent of tools/) holds megatron/training.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy  # noqa: E402

import megatron.training  # noqa: E402,F401 - first: mutes megatron-core's notes (fallbacks.py)
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.tokenizer_files import (  # noqa: E402
    SUPPORTED_TOKENIZERS,
    TokenizerError,
    write_dataset_tokenizer_info,
)
from reft_ext.report.progress import Progress  # noqa: E402

DOCUMENT_LEVEL = "document"


def open_text(path: str) -> io.TextIOBase:
    """Open plain / .gz / .xz text for reading as UTF-8."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _open_raw_text(path: str, raw) -> io.TextIOBase:
    """open_text over an already open binary file ``raw``, whose tell() is then the input
    offset reached (compressed bytes for .gz/.xz): a progress measure known up front."""
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw, mode="rb")
    elif path.endswith(".xz"):
        raw = lzma.LZMAFile(raw)
    return io.TextIOWrapper(raw, encoding="utf-8")


def output_prefix_for(output_prefix: str, key: str) -> str:
    """`<prefix>_<key>_document`, unless the prefix already carries that suffix."""
    suffix = f"_{key}_{DOCUMENT_LEVEL}"
    return output_prefix if output_prefix.endswith(suffix) else output_prefix + suffix


def _make_tokenizer(tokenizer_type: str, vocab_size: Optional[int],
                    tokenizer_model: Optional[str] = None):
    ns = argparse.Namespace(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, padded_vocab_size=None,
    )
    return build_tokenizer(ns)


def tokenizer_info(tokenizer, tokenizer_model: Optional[str], key: str, append_eod: bool) -> dict:
    """The record written next to a dataset: what training compares (`identity`) and, for
    people and converters, where the tokenizer was and what its special ids are."""
    return {"identity": tokenizer.identity,
            "tokenizer_model": os.path.abspath(tokenizer_model) if tokenizer_model else None,
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
            "pad": getattr(tokenizer, "pad", None), "json_key": key, "append_eod": append_eod}


class _Encoder:
    """Per-process tokenizer state. A class (not a closure) so multiprocessing can use it."""

    tokenizer = None
    keys: Sequence[str] = ("text",)
    append_eod = False

    @classmethod
    def initialize(cls, tokenizer_type, vocab_size, keys, append_eod, tokenizer_model=None):
        cls.tokenizer = _make_tokenizer(tokenizer_type, vocab_size, tokenizer_model)
        cls.keys, cls.append_eod = tuple(keys), append_eod

    @classmethod
    def encode(cls, line: str) -> Tuple[Optional[Dict[str, List[int]]], int]:
        """One JSONL line -> ({key: token ids}, utf-8 bytes read); (None, n) for blank lines."""
        if not line.strip():
            return None, len(line)
        doc = json.loads(line)
        out = {}
        for key in cls.keys:
            if key not in doc:
                raise KeyError(f"JSON key {key!r} missing in line: {line[:80]!r}")
            ids = cls.tokenizer.tokenize(doc[key]) if doc[key] else []
            if ids and cls.append_eod:
                ids.append(cls.tokenizer.eod)
            out[key] = ids
        return out, len(line.encode("utf-8"))

    @classmethod
    def encode_at(cls, item: Tuple[str, int]) -> Tuple[Optional[Dict[str, List[int]]], int, int]:
        """(line, input offset) -> (encode(line)..., input offset): the offset rides along
        through the pool, so progress follows the documents written, not the lines read."""
        line, offset = item
        return (*cls.encode(line), offset)


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str = "ByteLevelTokenizer",
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    vocab_size: Optional[int] = None,
    log_interval: int = 1000,
    quiet: bool = False,
    tokenizer_model: Optional[str] = None,
) -> Dict[str, str]:
    """Tokenize `input_path` and write one indexed dataset per JSON key, each with its
    tokenizer record (`<prefix>.tokenizer-info.json`).

    Returns {key: written path prefix}. `workers > 1` tokenizes in a process pool; imap keeps
    the input order, so the files are byte-identical to `workers=1`. Progress over the input's
    bytes goes to stderr (reft_ext.report.progress); `log_interval` is kept for compatibility
    and unused. Raises TokenizerError (naming the flag) for an unusable tokenizer.
    """
    tokenizer = _make_tokenizer(tokenizer_type, vocab_size, tokenizer_model)
    # uint16 tokens for vocabularies below 65500 (byte-level: 2 bytes/token), int32 otherwise;
    # megatron-core reads the dtype back from the .idx header.
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = {k: output_prefix_for(output_prefix, k) for k in json_keys}
    tmp = f".tmp{os.getpid()}"
    builders = {}
    for key, prefix in prefixes.items():
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        builders[key] = IndexedDatasetBuilder(prefix + tmp + ".bin", dtype=dtype)

    pool = None
    total = os.path.getsize(input_path)
    with open(input_path, "rb") as raw, _open_raw_text(input_path, raw) as lines:
        items = ((line, raw.tell()) for line in lines)
        init = (tokenizer_type, vocab_size, json_keys, append_eod, tokenizer_model)
        if workers > 1:
            # the processes are the parallelism: Hugging Face tokenizers' Rust thread pool in
            # forked children would only oversubscribe the cores (and it warns about forks)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            pool = multiprocessing.get_context("fork").Pool(
                workers, initializer=_Encoder.initialize, initargs=init)
            encoded: Iterable = pool.imap(_Encoder.encode_at, items, chunksize=64)
        else:
            _Encoder.initialize(*init)
            encoded = map(_Encoder.encode_at, items)
        docs = skipped = 0
        # progress over input bytes (compressed bytes for .gz/.xz), stderr, time-based
        with Progress(total, os.path.basename(input_path), unit="B", disable=quiet) as bar:
            try:
                for doc, _, offset in encoded:
                    bar.update(offset - bar.n)
                    if doc is None:
                        continue
                    for key, ids in doc.items():
                        if not ids:
                            skipped += 1
                            continue
                        builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                    docs += 1
            finally:
                if pool is not None:
                    pool.close()
                    pool.join()
            bar.update(total - bar.n)  # the whole input was read

    for key, prefix in prefixes.items():
        builders[key].finalize(prefix + tmp + ".idx")
        # .bin first, then the tokenizer record, .idx last: readers test for both files, and
        # the set is only complete once the .idx appears.
        os.replace(prefix + tmp + ".bin", prefix + ".bin")
        write_dataset_tokenizer_info(prefix, tokenizer_info(tokenizer, tokenizer_model, key,
                                                            append_eod))
        os.replace(prefix + tmp + ".idx", prefix + ".idx")
    if not quiet:
        print(f"wrote {docs} documents ({skipped} empty skipped) from {input_path} -> "
              f"{', '.join(p + '.{bin,idx}' for p in prefixes.values())}", file=sys.stderr)
    return prefixes


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="JSONL -> megatron-core indexed dataset (.bin/.idx)")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file (.jsonl, .jsonl.gz, .jsonl.xz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   choices=list(SUPPORTED_TOKENIZERS))
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="HuggingFaceTokenizer: a tokenizer.json or a tokenizer directory; "
                        "SentencePieceTokenizer: a .model file (local files only)")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="append <eod> to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes <prefix>_<key>_document.{bin,idx}")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes (output identical to --workers 1)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="accepted for Megatron-LM compatibility; progress (stderr, over input "
                        "bytes) is time-based: a redrawn line on a terminal, else a line every "
                        "REFT_PROGRESS_EVERY_S (10) s; REFT_NO_PROGRESS=1 turns it off")
    g.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    a = get_args(argv)
    if a.workers < 1:
        sys.exit(f"preprocess_data.py: error: --workers {a.workers}: must be >= 1")
    t0 = time.time()
    try:
        preprocess_jsonl(a.input, a.output_prefix, a.tokenizer_type, a.json_keys, a.append_eod,
                         a.workers, a.vocab_size, a.log_interval, a.quiet, a.tokenizer_model)
    except TokenizerError as exc:  # one line naming the flag, not a traceback
        sys.exit(f"preprocess_data.py: error: {exc}")
    if not a.quiet:
        print(f"done in {time.time() - t0:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
