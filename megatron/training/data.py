"""Pretraining data pipeline: megatron-core GPT datasets + a resumable, DP-sliced sampler.

Entry point for the training loop: `build_train_valid_test_data_iterators(args, tokenizer,
consumed_train_samples, consumed_valid_samples)`. It is a COLLECTIVE when torch.distributed is
initialized (megatron-core's dataset builder barriers on the default group so that global rank 0
writes the index cache before the other ranks read it): call it on every rank. In a generation
of an in-process restart (`collective=False` on every rank) it makes no collectives and reuses
the datasets the process holds (dataset_cache.py).

Data order is a pure function of (args.seed, consumed samples):
  * GPTDataset's document/sample/shuffle indices depend only on the seed, sequence length, split,
    requested sample count and the data (megatron-core hashes exactly these into the cache name);
  * MegatronPretrainingSampler walks global sample ids consumed, consumed+1, ... in chunks of
    micro_batch_size * dp_size and gives rank r the r-th micro-batch of each chunk. Global batch k
    is therefore samples [k*gbs, (k+1)*gbs) whatever the DP size, and resuming at consumed=k*gbs
    continues with exactly the batches an uninterrupted run would have seen.

The attention mask: on CPU it must come from the dataloader. megatron-core's local-spec
DotProductAttention passes the mask to FusedScaleMaskSoftmax; the fused CUDA kernel (fp16/bf16 on
GPU) ignores it for AttnMaskType.causal, but the torch fallback used on CPU builds a missing
causal mask with `device="cuda"` (transformer/utils.get_default_causal_mask) and fails. So
create_attention_mask defaults to True (bool [mbs,1,seq,seq], True = masked out);
`args.create_attention_mask_in_dataloader = False` may drop it on GPU only.
"""

import argparse
import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import os
import struct
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron.training import dataset_cache
from reft_ext import safe_dir
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


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------
class MegatronPretrainingSampler:
    """Batch sampler over global sample ids [consumed_samples, total_samples).

    Same contract as Megatron-LM's sampler of this name: every step takes the next
    micro_batch_size * data_parallel_size ids and yields this rank's contiguous slice of them.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0 or micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("total_samples, micro_batch_size, data_parallel_size must be > 0")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        if consumed_samples < 0:
            raise ValueError("consumed_samples must be >= 0")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples  # may be >= total: nothing left to yield
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        left = max(self.total_samples - self.consumed_samples, 0)
        return left // self.step if self.drop_last else -(-left // self.step)

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples
        lo = self.data_parallel_rank * self.micro_batch_size
        while start + self.step <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self.step
        if not self.drop_last and start < self.total_samples:
            # Last partial step: this rank's share of what is left, possibly empty.
            ids = list(range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples)))
            if ids:
                yield ids


# --------------------------------------------------------------------------------------------
# Helpers, corpus preprocessing, cache location
# --------------------------------------------------------------------------------------------
def default_data_cache_root() -> str:
    """The job's own cache root: $XDG_CACHE_HOME/reft-megatron/data-cache, or
    ~/.cache/reft-megatron/data-cache. Never a fixed name in the shared temp dir: megatron-core
    loads the cached index files with np.load(allow_pickle=True), so whoever can write the cache
    directory can run code as the training user."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "reft-megatron", "data-cache")


class UnsafeCacheDirError(ValueError):
    """A cache/lock directory another user could write or swap (a symlink, another user's,
    writable by group/others, or below such a directory): refused."""


def _open_private(path: str, what: str) -> safe_dir.SafeDir:
    """`path` opened from / one directory at a time (reft_ext/safe_dir.py), created
    0700 if missing: this user's, not writable by group/others, not a symlink, and below
    directories nobody else can write or swap. UnsafeCacheDirError with a one-line message
    naming it otherwise. Safe to call from many processes at once."""
    path = os.path.abspath(path)
    lock = what.startswith("lock")
    fix = ("remove it or set XDG_CACHE_HOME to a directory you own" if lock
           else "choose another --data-cache-path (or remove it)")
    try:
        return safe_dir.open_dir(path, create=True)
    except safe_dir.UnsafePathError as exc:
        why = exc.reason
        if exc.component == path and "writable by group or others" in why:
            fix = f"chmod 700 {path} or {fix}"
    except NotADirectoryError:
        why = "is not a directory (or a directory above it is not)"
    risk = ("another user could plant files there" if lock else
            "megatron-core loads pickled index files from it, so another user who can write "
            "or swap it could run code as you")
    raise UnsafeCacheDirError(f"refusing {what} {path}: it {why}; {fix} ({risk})")


def private_dir(path: str, what: str = "data cache directory") -> str:
    """Create `path` (mode 0700) if missing and return its absolute path, after checking it
    and every directory above it (_open_private). For a check; code that reads or writes
    there takes the held directory (_held_dir), not this name."""
    _open_private(path, what).close()
    return os.path.abspath(path)


_held: dict = {}  # (absolute path, subdirectory) -> SafeDir, open for the process's life


def _held_dir(path: str, sub: Optional[str] = None) -> str:
    """`path` (and its subdirectory `sub`), checked as private_dir does and held open for
    the life of the process; returns /proc/self/fd/<fd>, a name of the checked directory
    itself: megatron-core opens its cached index files by name, and through this one a
    directory renamed or swapped after the check (renameat2 RENAME_EXCHANGE) changes
    nothing. The same name every time in one process (the dataset cache's key,
    dataset_cache.py); forked DataLoader workers inherit the descriptor."""
    key = (os.path.abspath(path), sub)
    if key not in _held:
        d = _open_private(path, "data cache directory")
        if sub is not None:
            with d:  # (the parent: closed once its subdirectory is held)
                try:
                    d = d.subdir(sub, create=True)
                except safe_dir.UnsafePathError as exc:
                    raise UnsafeCacheDirError(
                        f"refusing data cache directory {exc.path}: it {exc.reason}; remove "
                        f"it (megatron-core loads pickled index files from it)") from None
        _held[key] = d
    return _held[key].proc_path


def data_cache_path_error(path: Optional[str]) -> Optional[str]:
    """What is wrong with --data-cache-path (or, when None, the default cache root), or None.
    One line, for argument validation: the same check the dataset builder makes on every rank."""
    try:
        private_dir(path or default_data_cache_root())
    except (UnsafeCacheDirError, OSError) as e:
        return str(e)
    return None


@contextlib.contextmanager
def _file_lock(name: str):
    """Inter-process lock (one per machine) in the user's private cache directory
    (<default_data_cache_root()>/.locks, 0700, opened from / as private_dir checks it); needs
    no torch.distributed, so any subset of ranks, or separate jobs, can call the functions
    that use it. Opened through the checked directory's descriptor with O_NOFOLLOW: a symlink
    planted at the lock path is never followed."""
    root = default_data_cache_root()
    with _open_private(root, "data cache directory") as top:
        try:
            locks = top.subdir(".locks", create=True)
        except safe_dir.UnsafePathError as exc:
            raise UnsafeCacheDirError(
                f"refusing lock directory {exc.path}: it {exc.reason}; remove it or set "
                f"XDG_CACHE_HOME to a directory you own (another user could plant files "
                f"there)") from None
    path = os.path.join(locks.path, f"megatron_data_{name}.lock")
    try:
        fd = locks.open(os.path.basename(path), os.O_RDWR | os.O_CREAT)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCacheDirError(
                f"refusing lock file {path}: it is a symlink; remove it") from None
        raise
    finally:
        locks.close()
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_dataset_helpers() -> None:
    """Make `megatron.core.datasets.helpers_cpp` importable (builds the sample index).

    The megatron-core 0.16.1 wheel ships it compiled (helpers_cpp.cpython-*.so), so this is
    normally just an import. For an install without it (e.g. another Python ABI) it compiles
    helpers.cpp next to itself with pybind11, like Megatron's Makefile, once per machine under a
    file lock; the wheel carries no Makefile, so megatron's own compile_helpers() cannot do it.
    """
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")  # (imported: built)
        return
    except ImportError:
        pass
    import subprocess
    import sysconfig

    import megatron.core.datasets as ds
    import pybind11

    src_dir = os.path.dirname(ds.__file__)
    target = os.path.join(src_dir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    with _file_lock("helpers_cpp"):
        if not os.path.exists(target):
            tmp = f"{target}.tmp{os.getpid()}"
            cmd = [os.environ.get("CXX", "c++"), "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC",
                   f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                   os.path.join(src_dir, "helpers.cpp"), "-o", tmp]
            subprocess.run(cmd, check=True)
            os.replace(tmp, target)
    importlib.invalidate_caches()
    importlib.import_module("megatron.core.datasets.helpers_cpp")  # fail here, not mid-build


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


def _data_fingerprint(prefixes: List[str]) -> str:
    """Content hash of the indexed datasets (.idx bytes, .bin size). megatron-core's cache names
    hash the prefix path but not the data, so a corpus rebuilt under the same prefix would reuse
    stale indices; keying the cache directory by content prevents that. Path-free, so ranks that
    mount the data at different paths still agree."""
    h = hashlib.sha1()
    for p in prefixes:
        h.update(str(os.path.getsize(get_bin_path(p))).encode())
        with open(get_idx_path(p), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def data_cache_path(args, prefixes: List[str]) -> str:
    """<args.data_cache_path or default_data_cache_root()>/<data fingerprint>, both checked as
    private_dir does (created 0700; refused when a symlink, another user's, writable by
    group/others, or below a directory another user could swap) and returned as the held
    directory's /proc/self/fd name (_held_dir). Must be one directory every rank sees (shared
    FS for multi-node): rank 0 writes, then the others read after the builder's barrier."""
    root = getattr(args, "data_cache_path", None) or default_data_cache_root()
    return _held_dir(root, _data_fingerprint(prefixes))


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------
def train_valid_test_num_samples(args) -> Tuple[int, int, int]:
    """Megatron's sample counts: train = iters * gbs (or args.train_samples when train_iters is
    None); valid covers every evaluation of the run; test is one evaluation."""
    gbs = args.global_batch_size
    train_iters = args.train_iters
    if train_iters is None:
        train_iters = -(-args.train_samples // gbs)
    evals = train_iters // args.eval_interval + 1 if args.eval_interval else 1
    return train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs


def _blends(args):
    """(blend, blend_per_split) from --data-path or --{train,valid,test}-data-path."""
    def as_list(v):
        return v.split() if isinstance(v, str) else v

    per_split = [get_blend_from_list(as_list(getattr(args, f"{s}_data_path", None)))
                 for s in ("train", "valid", "test")]
    if any(per_split):
        return None, per_split
    return get_blend_from_list(as_list(getattr(args, "data_path", None))), None


def _num_documents(prefix: str) -> int:
    """Sequence count from the .idx header (magic 9 B, version 8 B, dtype 1 B, count 8 B)."""
    with open(get_idx_path(prefix), "rb") as f:
        return struct.unpack("<Q", f.read(26)[18:26])[0]


def _check_splits_nonempty(config: GPTDatasetConfig) -> None:
    """megatron-core loops forever computing the epoch count of a split with no documents
    (GPTDataset._get_num_epochs adds 0 tokens per epoch); fail loudly instead."""
    if config.blend is None:
        return
    for prefix in config.blend[0]:
        n = _num_documents(prefix)
        for split, bounds in zip(Split, config.split_matrix):
            if bounds is not None and int(round(bounds[1] * n)) <= int(round(bounds[0] * n)):
                raise ValueError(
                    f"--split {config.split!r} gives the {split.name} split of {prefix} no "
                    f"documents ({n} in total); give it weight 0 or use more data")


def gpt_dataset_config_from_args(args, tokenizer, path_to_cache: Optional[str]) -> GPTDatasetConfig:
    blend, blend_per_split = _blends(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split if blend is not None else None,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", True),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
    )


def build_train_valid_test_datasets(args, tokenizer, collective: bool = True):
    """(train, valid, test) megatron-core datasets; None for a split with weight 0.
    Data: --mock-data, else --data-path / --{train,valid,test}-data-path, else the shipped
    corpus (DEFAULT_DATA_PREFIX). ``collective`` False: no barriers, the datasets this
    process built before if it did (a rejoin: dataset_cache.py)."""
    ensure_dataset_helpers()
    if getattr(args, "mock_data", False):
        cls, cache = MockGPTDataset, getattr(args, "data_cache_path", None)
        if cache:
            cache = _held_dir(cache)
        args = _with(args, data_path=None, train_data_path=None, valid_data_path=None,
                     test_data_path=None)
    else:
        cls = GPTDataset
        blend, per_split = _blends(args)
        if blend is None and per_split is None:
            # Neither --data-path nor --mock-data: the default job trains on the shipped corpus.
            args = _with(args, data_path=[DEFAULT_DATA_PREFIX])
            blend, per_split = _blends(args)
        prefixes = blend[0] if blend else [p for b in per_split if b for p in b[0]]
        if getattr(args, "tokenizer_type", "ByteLevelTokenizer") == "ByteLevelTokenizer":
            for p in prefixes:  # tokenize a JSONL corpus found next to the prefix on first use
                ensure_preprocessed(p, tokenizer_type="ByteLevelTokenizer")
        # ids read with another vocabulary than the one that made them: refused
        check_dataset_tokenizer(prefixes, tokenizer, getattr(args, "tokenizer_model", None))
        cache = data_cache_path(args, prefixes)
    config = gpt_dataset_config_from_args(args, tokenizer, cache)
    _check_splits_nonempty(config)
    return list(dataset_cache.build(cls, train_valid_test_num_samples(args), config,
                                    collective=collective))


def _with(args, **overrides):
    """A copy of args with some attributes replaced (the caller's args stay untouched)."""
    ns = argparse.Namespace(**vars(args))
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


# --------------------------------------------------------------------------------------------
# Loaders and iterators
# --------------------------------------------------------------------------------------------
def build_pretraining_data_loader(dataset, consumed_samples: int, args, dp_rank: int,
                                  dp_size: int) -> torch.utils.data.DataLoader:
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                         dp_rank, dp_size)
    workers = getattr(args, "num_workers", 0) or 0
    # A DataLoader draws its workers' base seed from `generator` each time an iterator is
    # made; without one it draws from torch's global generator, i.e. from the training RNG
    # (dropout), at times that differ between a fresh and a resumed run. Its own generator
    # keeps the training RNG stream a function of the iteration alone.
    generator = torch.Generator().manual_seed(int(getattr(args, "seed", 0)) + consumed_samples)
    # pinned on a GPU host: forward_step's batch copies run non-blocking
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=workers > 0, generator=generator)


def _cyclic_iterator(dataset, consumed_samples: int, args, dp_rank: int, dp_size: int):
    """Evaluation data never runs out: after the first pass (from `consumed_samples`) it starts
    again at sample 0. Positions stay global-batch aligned, so DP ranks stay in step."""
    step = args.micro_batch_size * dp_size
    usable = len(dataset) // step * step
    if usable == 0:
        raise ValueError(f"evaluation split has {len(dataset)} samples < one step of {step}")
    consumed = consumed_samples % usable
    while True:
        yield from build_pretraining_data_loader(dataset, consumed, args, dp_rank, dp_size)
        consumed = 0


def build_train_valid_test_data_iterators(args, tokenizer, consumed_train_samples: int,
                                          consumed_valid_samples: int, *,
                                          collective: bool = True,
                                          data_parallel_rank: Optional[int] = None,
                                          data_parallel_size: Optional[int] = None):
    """(train_iter, valid_iter, test_iter) over this rank's micro-batches.

    Each micro-batch is a dict of CPU tensors: tokens/labels/position_ids int64 [mbs, seq],
    loss_mask float32 [mbs, seq], attention_mask bool [mbs, 1, seq, seq] (absent when
    create_attention_mask_in_dataloader is False). train_iter is a single pass starting at
    consumed_train_samples; valid/test iterators cycle. valid/test are None when eval_iters == 0
    or their split weight is 0. DP rank/size come from parallel_state (or (0, 1) when it is not
    initialized); the keyword overrides exist for tests.
    """
    if data_parallel_rank is None or data_parallel_size is None:
        if parallel_state.model_parallel_is_initialized():
            data_parallel_rank = parallel_state.get_data_parallel_rank()
            data_parallel_size = parallel_state.get_data_parallel_world_size()
        else:
            data_parallel_rank, data_parallel_size = 0, 1
    if args.global_batch_size % (args.micro_batch_size * data_parallel_size):
        raise ValueError("global_batch_size must be a multiple of micro_batch_size * dp size")

    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(args, tokenizer, collective)
    if getattr(args, "poison_train_samples", None) and train_ds is not None:
        from megatron.training.poisoned_samples import PoisonedSamples, parse_sample_ranges

        train_ds = PoisonedSamples(train_ds, parse_sample_ranges(args.poison_train_samples))
    dp = (data_parallel_rank, data_parallel_size)
    train_iter = (iter(build_pretraining_data_loader(train_ds, consumed_train_samples, args, *dp))
                  if train_ds is not None else None)
    evaluate = getattr(args, "eval_iters", 0) > 0
    valid_iter = (_cyclic_iterator(valid_ds, consumed_valid_samples, args, *dp)
                  if evaluate and valid_ds is not None else None)
    test_iter = (_cyclic_iterator(test_ds, 0, args, *dp)
                 if evaluate and test_ds is not None else None)
    return train_iter, valid_iter, test_iter
