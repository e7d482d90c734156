#!/usr/bin/env python3
"""Rebuild the shipped public-domain corpus `data/pd_english.jsonl.gz` from Debian packages.

This is NOT run by training; the corpus is committed. The script exists so the provenance in
data/README.md is reproducible byte for byte:

    apt-get install -y bible-kjv dict-devil      # bible-kjv pulls in bible-kjv-text
    python data/build_corpus.py                  # writes data/pd_english.jsonl.gz

Sources (both public domain, see data/README.md):
  * King James Version of the Bible (1611), from Debian `bible-kjv-text`, dumped with the
    `bible` program of Debian `bible-kjv`: one document per chapter (1189 documents).
  * "The Devil's Dictionary" by Ambrose Bierce (1911), from Debian `dict-devil`
    (/usr/share/dictd/devil.dict.dz + devil.index): one document per entry, plus the preface.

Documents are shuffled with a fixed seed before writing. Why: megatron-core's `--split` cuts the
document list into contiguous ranges, so an unshuffled file would put only Devil's Dictionary
entries (the tail) in the validation/test splits.
"""

import argparse
import gzip
import json
import random
import re
import subprocess
from typing import Iterator, List, Tuple

DICT_DIR = "/usr/share/dictd"
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def kjv_chapters() -> Iterator[Tuple[str, str]]:
    """Yield (id, text) per chapter: a 'Book N' title line, a blank line, one verse per line."""
    # -l100000: no line wrapping inside verses; the range covers the whole canon.
    out = subprocess.run(
        ["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    title, verses = None, []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            verses.append(m.group(2).strip())
            continue
        if title is not None:
            yield title, title + "\n\n" + "\n".join(verses) + "\n"
        title, verses = line.strip(), []
    if title is not None:
        yield title, title + "\n\n" + "\n".join(verses) + "\n"


def _b64(s: str) -> int:
    """dictd's index encodes offsets/lengths in its own base64 digits (most significant first)."""
    n = 0
    for ch in s:
        n = n * 64 + B64.index(ch)
    return n


def devils_dictionary_entries() -> Iterator[Tuple[str, str]]:
    """Yield (id, text) per dictionary entry, in the order of the dictd index."""
    with gzip.open(f"{DICT_DIR}/devil.dict.dz", "rb") as f:  # dictzip is gzip-compatible
        body = f.read()
    seen = set()
    with open(f"{DICT_DIR}/devil.index", encoding="utf-8") as f:
        for line in f:
            word, off, length = line.rstrip("\n").split("\t")
            span = (_b64(off), _b64(length))
            if span in seen:  # alternate headwords point at the same definition
                continue
            seen.add(span)
            text = body[span[0] : span[0] + span[1]].decode("latin-1")
            if word == "00databaseinfo":
                # Keep Bierce's preface, drop the dictd/Internet Wiretap header above it.
                i = text.find("PREFACE")
                if i < 0:
                    continue
                text, word = text[i:], "preface"
            elif word.startswith("00database"):
                continue
            text = text.strip("\n")
            if text:
                yield word, text + "\n"


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="data/pd_english.jsonl.gz")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)

    docs = [{"id": f"kjv/{k}", "source": "kjv", "text": t} for k, t in kjv_chapters()]
    docs += [
        {"id": f"devil/{k}", "source": "devils_dictionary", "text": t}
        for k, t in devils_dictionary_entries()
    ]
    random.Random(args.seed).shuffle(docs)
    # mtime=0 keeps the .gz byte-identical across rebuilds.
    with gzip.GzipFile(args.output, "wb", compresslevel=9, mtime=0) as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    n_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
    print(f"wrote {len(docs)} documents, {n_bytes} text bytes -> {args.output}")


if __name__ == "__main__":
    main()
