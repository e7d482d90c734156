"""The files behind a tokenizer: checks of --tokenizer-model, the tokenizer's identity (its
type and the sha256 of its files) and the record of it that a dataset keeps next to its
.bin/.idx (`<prefix>.tokenizer-info.json`).

Standard library only (sentencepiece when it checks a .model): argument validation and
tools/preprocess_data.py use it without importing transformers (~3 s) or torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from typing import Dict, List, Optional, Tuple

from reft_ext.report.files import replace_with

SUPPORTED_TOKENIZERS = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                        "NullTokenizer")
# the tokenizers that read --tokenizer-model
FILE_TOKENIZERS = ("HuggingFaceTokenizer", "SentencePieceTokenizer")
_WHAT = {"HuggingFaceTokenizer": "a tokenizer.json file or a Hugging Face tokenizer directory "
                                 "(tokenizer.json / tokenizer_config.json)",
         "SentencePieceTokenizer": "a SentencePiece .model file"}
_INSTALL = "pip install -e '.[hf]'"
# A Hugging Face directory's tokenizer files: hashed (identity) and the ones a converter copies;
# never the model weights that often sit next to them (gigabytes).
_HF_NAMES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
             "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
INFO_SUFFIX = ".tokenizer-info.json"
INFO_FORMAT = 1


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message starts with the flag to change."""


def tokenizer_model_files(path: str) -> List[str]:
    """The files that define the tokenizer at `path`: the file itself, or a directory's
    tokenizer* files and the vocab/merges/special-token files next to them."""
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path)
                   if (n.startswith("tokenizer") or n in _HF_NAMES)
                   and os.path.isfile(os.path.join(path, n)))
    return [os.path.join(path, n) for n in names]


def tokenizer_model_error(kind: str, path: Optional[str]) -> Optional[Tuple[str, str]]:
    """(flag, why) when --tokenizer-type KIND with --tokenizer-model PATH cannot work on this
    machine, else None. Local files only: a missing path is an error, never a download."""
    if kind not in SUPPORTED_TOKENIZERS:
        return ("--tokenizer-type", f"{kind!r} is not available; use one of "
                f"{', '.join(SUPPORTED_TOKENIZERS)}")
    if kind not in FILE_TOKENIZERS:
        if path:
            return ("--tokenizer-model", f"not used by --tokenizer-type {kind}: drop it, or give "
                    f"--tokenizer-type {' or '.join(FILE_TOKENIZERS)}")
        return None
    what = _WHAT[kind]
    if not path:
        return ("--tokenizer-model", f"required with --tokenizer-type {kind}: give {what} "
                f"(tools/train_tokenizer.py makes one)")
    module = "transformers" if kind == "HuggingFaceTokenizer" else "sentencepiece"
    if importlib.util.find_spec(module) is None:
        return ("--tokenizer-type", f"{kind} needs the {module} package: {_INSTALL}")
    if not os.path.exists(path):
        return ("--tokenizer-model", f"{path}: no such file or directory; give {what} on this "
                f"machine (local files only: nothing is downloaded, so fetch a hub tokenizer "
                f"into a directory first)")
    if kind == "SentencePieceTokenizer":
        if os.path.isdir(path):
            return ("--tokenizer-model", f"{path} is a directory; give the .model file in it")
        import sentencepiece

        try:  # a protobuf: only loading it tells
            sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as exc:  # noqa: BLE001 - any failure means "not a model"
            return ("--tokenizer-model", f"{path} is not a SentencePiece model ({exc}); give "
                    f"{what}")
        return None
    if os.path.isdir(path):
        if not {"tokenizer.json", "tokenizer_config.json"} & set(os.listdir(path)):
            return ("--tokenizer-model", f"{path} has no tokenizer.json or tokenizer_config.json:"
                    f" not a Hugging Face tokenizer directory; give {what}")
        return None
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        return ("--tokenizer-model", f"{path} is not a tokenizer.json ({exc}); give {what}")
    if not isinstance(doc, dict) or "model" not in doc:
        return ("--tokenizer-model", f"{path} is JSON but not a tokenizers tokenizer.json (no "
                f"'model'); give {what}")
    return None


def check_tokenizer_model(kind: str, path: Optional[str]) -> None:
    """tokenizer_model_error as an exception (TokenizerError, the message names the flag)."""
    err = tokenizer_model_error(kind, path)
    if err:
        raise TokenizerError(f"{err[0]}: {err[1]}")


_HASHES: Dict[Tuple, str] = {}


def _sha256_file(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _HASHES:  # validation, the tokenizer and the data check all ask
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def tokenizer_files_sha256(path: str) -> str:
    """Content hash of a tokenizer: of the file, or of a directory's tokenizer files (names and
    contents). Path-free, so the same tokenizer copied elsewhere has the same identity."""
    if os.path.isfile(path):
        return _sha256_file(path)
    h = hashlib.sha256()
    for f in tokenizer_model_files(path):
        h.update(f"{os.path.basename(f)}\0{_sha256_file(f)}\n".encode())
    return h.hexdigest()


def tokenizer_identity(kind: str, model: Optional[str] = None,
                       vocab_size: Optional[int] = None) -> dict:
    """What makes two tokenizers produce the same ids: the type, plus the files' sha256
    (file-based tokenizers) or the vocabulary size (NullTokenizer)."""
    ident = {"tokenizer_type": kind}
    if kind in FILE_TOKENIZERS:
        ident["sha256"] = tokenizer_files_sha256(model)
    elif kind == "NullTokenizer":
        ident["vocab_size"] = int(vocab_size)
    return ident


def identity_from_args(args) -> dict:
    """tokenizer_identity for what `args` names (what build_tokenizer builds), without
    building it: the null tokenizer's --vocab-size is its vocabulary (tokenizer.py)."""
    kind = getattr(args, "tokenizer_type", None) or "ByteLevelTokenizer"
    return tokenizer_identity(kind, getattr(args, "tokenizer_model", None),
                              getattr(args, "vocab_size", None))


def tokenizer_flags(ident: dict, model: Optional[str] = None) -> str:
    """The flags that name a tokenizer: `--tokenizer-type T [--tokenizer-model M|--vocab-size N]`
    (`...` for a file-based one whose path is not known)."""
    out = f"--tokenizer-type {ident.get('tokenizer_type')}"
    if ident.get("tokenizer_type") in FILE_TOKENIZERS:
        out += f" --tokenizer-model {model or '...'}"
    if "vocab_size" in ident:
        out += f" --vocab-size {ident['vocab_size']}"
    return out


def describe_identity(ident: dict, model: Optional[str] = None) -> str:
    """tokenizer_flags plus the files' hash, for error messages."""
    out = tokenizer_flags(ident, model)
    return out + (f" (files sha256 {ident['sha256'][:12]}...)" if "sha256" in ident else "")


def dataset_tokenizer_info_path(prefix: str) -> str:
    return prefix + INFO_SUFFIX


def write_dataset_tokenizer_info(prefix: str, info: dict) -> None:
    """Record a dataset's tokenizer next to its .bin/.idx, atomically (tmp + rename)."""
    path = dataset_tokenizer_info_path(prefix)
    # a fresh O_EXCL|O_NOFOLLOW temporary, renamed: a planted link is never written through
    replace_with(path, json.dumps({"format": INFO_FORMAT, **info}, indent=1,
                                  sort_keys=True) + "\n")


def read_dataset_tokenizer_info(prefix: str) -> Optional[dict]:
    """The tokenizer record of dataset `prefix`, or None for a dataset made without one
    (by Megatron-LM's tool, or by this repository before datasets recorded it)."""
    path = dataset_tokenizer_info_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        if not isinstance(info.get("identity"), dict):
            raise ValueError("no 'identity'")
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"--data-path: {path} is unreadable ({exc}); re-run "
                             f"tools/preprocess_data.py for {prefix}") from None
    return info
