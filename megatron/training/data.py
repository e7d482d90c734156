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

Where the data comes from and where its index cache lives are their own modules:
dataset_files.py (the --data-path datasets: built from their JSONL, checked against the
tokenizer) and data_cache_dir.py (the private cache directory and the data locks).
"""

import argparse
import importlib
import os
import struct
from typing import Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import get_idx_path
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron.training import dataset_cache
from megatron.training.utils import print_rank_0
from megatron.training.data_cache_dir import _file_lock, _held_dir, data_cache_path
from megatron.training.dataset_files import (
    DEFAULT_DATA_PREFIX,
    check_dataset_tokenizer,
    ensure_preprocessed,
)


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
# Datasets
# --------------------------------------------------------------------------------------------
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

    sizes = train_valid_test_num_samples(args)
    if collective:  # Megatron-LM's lines (a rejoin builds nothing new: no lines)
        print_rank_0("> building train, validation, and test datasets ...\n"
                     " > datasets target sizes (minimum size):\n"
                     f"    train:      {sizes[0]}\n    validation: {sizes[1]}\n"
                     f"    test:       {sizes[2]}\n"
                     "> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(args, tokenizer, collective)
    if collective:
        print_rank_0("> finished creating GPT datasets ...")
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
