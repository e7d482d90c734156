"""The indexed datasets behind --data-path: built from their JSONL corpus, checked to exist
and to match the tokenizer.

A dataset prefix PREFIX names PREFIX.bin and PREFIX.idx (tools/preprocess_data.py writes
them); `data/X.jsonl.gz` <-> `data/X_text_document`. ensure_preprocessed tokenizes a JSONL
corpus found next to its prefix on first use (ByteLevelTokenizer); data_path_error and
dataset_tokenizer_error are argument validation's one-line checks, check_dataset_tokenizer
the dataset builder's, so token ids are never read with another vocabulary than the one that
made them. Split out of data.py, which builds megatron-core datasets from these prefixes.
"""

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
from megatron.core.datasets.utils import get_blend_from_list

from megatron.training.data_cache_dir import _file_lock
from megatron.training.tokenizer_files import (
    TokenizerError,
    describe_identity,
    read_dataset_tokenizer_info,
    tokenizer_flags,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# The shipped public-domain corpus and the prefix its .bin/.idx get (see data/README.md).
DEFAULT_CORPUS = str(REPO_ROOT / "data" / "pd_english.jsonl.gz")
DEFAULT_DATA_PREFIX = str(REPO_ROOT / "data" / "pd_english_text_document")
_CORPUS_EXTS = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".json")
_DOC_SUFFIX = "_text_document"


def _load_preprocess_tool():
    """tools/ is not a package; load tools/preprocess_data.py by path. Registered in sys.modules
    so that its --workers process pool can pickle references to its functions."""
    name = "_megatron_tools_preprocess_data"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO_ROOT / "tools" / "preprocess_data.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _corpus_and_prefix(prefix_or_jsonl: str) -> Tuple[Optional[str], str]:
    """Map a JSONL path to its dataset prefix, or a prefix to its source JSONL (if one exists)."""
    for ext in _CORPUS_EXTS:
        if prefix_or_jsonl.endswith(ext):
            return prefix_or_jsonl, prefix_or_jsonl[: -len(ext)] + _DOC_SUFFIX
    prefix = prefix_or_jsonl
    base = prefix[: -len(_DOC_SUFFIX)] if prefix.endswith(_DOC_SUFFIX) else prefix
    for ext in _CORPUS_EXTS:
        if os.path.isfile(base + ext):
            return base + ext, prefix
    return None, prefix


def _is_fresh(prefix: str, source: Optional[str]) -> bool:
    idx, bin_ = get_idx_path(prefix), get_bin_path(prefix)
    if not (os.path.isfile(idx) and os.path.isfile(bin_)):
        return False
    return source is None or os.path.getmtime(idx) >= os.path.getmtime(source)


def ensure_preprocessed(prefix_or_jsonl: str = DEFAULT_CORPUS,
                        tokenizer_type: str = "ByteLevelTokenizer", append_eod: bool = True,
                        quiet: bool = True) -> str:
    """Return the dataset prefix for a JSONL corpus (or prefix), tokenizing it first if its
    .bin/.idx are missing or older than the JSONL. `data/X.jsonl.gz` <-> `data/X_text_document`.

    Safe to call from many processes at once (file lock; the loser of the race finds fresh
    files). The shipped corpus takes well under a second to tokenize (plus imports).
    """
    source, prefix = _corpus_and_prefix(prefix_or_jsonl)
    if _is_fresh(prefix, source):
        return prefix
    if source is None:
        raise FileNotFoundError(f"no {prefix}.bin/.idx and no JSONL ({'/'.join(_CORPUS_EXTS)}) "
                                f"next to it to build them from")
    info = read_dataset_tokenizer_info(prefix)
    if info and info["identity"].get("tokenizer_type") != tokenizer_type:
        # someone's dataset made with another tokenizer: never overwrite it with ours
        raise TokenizerError(
            f"--data-path {prefix}: older than {source} but made with "
            f"{describe_identity(info['identity'], info.get('tokenizer_model'))}; re-run "
            f"tools/preprocess_data.py with that tokenizer, or remove {prefix}.bin/.idx")
    key = hashlib.sha1(os.path.abspath(prefix).encode()).hexdigest()[:16]
    with _file_lock(f"preprocess_{key}"):
        if not _is_fresh(prefix, source):
            _load_preprocess_tool().preprocess_jsonl(
                source, prefix, tokenizer_type=tokenizer_type, append_eod=append_eod, quiet=quiet)
    return prefix


def data_path_prefixes(paths: List[str]) -> List[str]:
    """The dataset prefixes of --data-path (prefixes, or weight/prefix pairs)."""
    try:
        return get_blend_from_list(list(paths))[0]
    except (AssertionError, ValueError):
        return list(paths)


def data_path_error(paths: List[str], tokenizer_type: str = "ByteLevelTokenizer") -> Optional[str]:
    """What is wrong with --data-path (prefixes, or weight/prefix pairs), or None: every
    prefix has its .bin and .idx, or (ByteLevelTokenizer) a JSONL corpus next to it that
    ensure_preprocessed tokenizes on first use. Checked at argument validation, so a
    typo is one error line and not a traceback per rank once the job is built."""
    if not paths:
        return "give at least one dataset prefix (PREFIX for PREFIX.bin/.idx), or --mock-data"
    for prefix in data_path_prefixes(paths):
        for ext in _CORPUS_EXTS:
            if prefix.endswith(ext):
                return (f"{prefix} is a JSONL corpus; give its dataset prefix "
                        f"{prefix[:-len(ext)] + _DOC_SUFFIX} (built from it on first use)")
        missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix))
                   if not os.path.isfile(p)]
        if not missing:
            continue
        source, _ = _corpus_and_prefix(prefix)
        if source is not None and tokenizer_type == "ByteLevelTokenizer":
            continue  # tokenized from the JSONL on first use
        why = f"no {' and no '.join(missing)}"
        if source is not None:
            why += (f" (the JSONL {source} next to it is tokenized on first use with "
                    f"--tokenizer-type ByteLevelTokenizer only: for {tokenizer_type} run "
                    f"tools/preprocess_data.py --input {source} --output-prefix {prefix} "
                    f"--tokenizer-type {tokenizer_type} --tokenizer-model ... --append-eod)")
        return (f"dataset prefix {prefix}: {why}; give PREFIX of existing PREFIX.bin and "
                f"PREFIX.idx (tools/preprocess_data.py writes them) or --mock-data")
    return None


def dataset_tokenizer_error(prefixes: List[str], identity: dict,
                            tokenizer_model: Optional[str] = None) -> Optional[str]:
    """Why the existing datasets `prefixes` cannot be read with the tokenizer `identity`
    (tokenizer_files.tokenizer_identity), or None. A dataset's ids mean something only in the
    vocabulary that made them: its `<prefix>.tokenizer-info.json` must name this tokenizer.
    Without a record, a dataset next to its JSONL was made by ensure_preprocessed, i.e. with
    ByteLevelTokenizer; any other one (Megatron-LM's tool) is range-checked when it is built."""
    for prefix in prefixes:
        if not (os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix))):
            continue  # data_path_error's business (or built from its JSONL on first use)
        info = read_dataset_tokenizer_info(prefix)
        if info is not None:
            recorded, model = info["identity"], info.get("tokenizer_model")
        elif _corpus_and_prefix(prefix)[0] is not None:
            recorded, model = {"tokenizer_type": "ByteLevelTokenizer"}, None
        else:
            continue
        if recorded != identity:
            fix = (f"tools/preprocess_data.py --input CORPUS --output-prefix NEW "
                   f"{tokenizer_flags(identity, tokenizer_model)} --append-eod")
            return (f"dataset {prefix} was tokenized with {describe_identity(recorded, model)}, "
                    f"this run has {describe_identity(identity, tokenizer_model)}: train with "
                    f"the tokenizer flags it was made with, or re-tokenize it with this one "
                    f"({fix}) and give --data-path NEW_text_document")
    return None


def _check_token_range(prefix: str, vocab_size: int, max_tokens: int = 1 << 22) -> None:
    """A dataset without a tokenizer record: its first `max_tokens` ids must fit the
    vocabulary (an id past it means another tokenizer, and an index error in the embedding)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType

    with open(get_idx_path(prefix), "rb") as f:
        code = f.read(18)[17]  # magic 9 B, version 8 B, dtype code 1 B
    dtype = DType.dtype_from_code(code)
    n = min(os.path.getsize(get_bin_path(prefix)) // numpy.dtype(dtype).itemsize, max_tokens)
    if n == 0:
        return
    top = int(numpy.memmap(get_bin_path(prefix), dtype=dtype, mode="r", shape=(n,)).max())
    if top >= vocab_size:
        raise TokenizerError(
            f"--tokenizer-type: dataset {prefix} holds token id {top}, outside this tokenizer's "
            f"vocabulary of {vocab_size}: it was made with another tokenizer; give the "
            f"--tokenizer-type/--tokenizer-model it was made with, or re-run "
            f"tools/preprocess_data.py with these")


def check_dataset_tokenizer(prefixes: List[str], tokenizer,
                            tokenizer_model: Optional[str] = None) -> None:
    """dataset_tokenizer_error as an exception (TokenizerError), plus the range check of
    datasets that carry no record. Tokenizers without an `identity` (built outside
    megatron/training/tokenizer.py) are not checked."""
    identity = getattr(tokenizer, "identity", None)
    if identity is None:
        return
    why = dataset_tokenizer_error(prefixes, identity, tokenizer_model)
    if why:
        raise TokenizerError(f"--data-path: {why}")
    for prefix in prefixes:
        if read_dataset_tokenizer_info(prefix) is None and _corpus_and_prefix(prefix)[0] is None:
            _check_token_range(prefix, tokenizer.vocab_size)
