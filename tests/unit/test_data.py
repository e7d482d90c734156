"""Data pipeline tests: tokenizers, preprocess tool, megatron-core GPT datasets, sampler, resume.

Everything runs on CPU in well under a minute: corpora are tiny (generated) except one test that
reads the shipped corpus; one test starts 4 gloo ranks to exercise megatron-core's
rank-0-builds / barrier / others-load cache protocol.
"""

import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.run import REPO as REPO_ROOT

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training import dataset_files  # noqa: E402
from megatron.training.data import (  # noqa: E402
    MegatronPretrainingSampler,
    build_train_valid_test_data_iterators,
)
from megatron.training.dataset_files import ensure_preprocessed  # noqa: E402
from megatron.training.poisoned_samples import parse_sample_ranges  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402

preprocess_tool = dataset_files._load_preprocess_tool()

TEXTS = [
    "In the beginning was the byte.\n",
    "Unicode survives: naïve café, ∑ and 😀, trailing spaces   ",
    "",  # skipped: empty documents are not written
    "Short.",
    "A longer document. " * 40,
]


def make_args(**overrides):
    args = argparse.Namespace(
        seed=1234, seq_length=32, micro_batch_size=2, global_batch_size=8, train_iters=20,
        eval_interval=10, eval_iters=2, data_path=None, split="90,9,1", mock_data=False,
        data_cache_path=None, num_workers=0, tokenizer_type="ByteLevelTokenizer", vocab_size=None,
        make_vocab_size_divisible_by=128, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tensor_model_parallel_size=1,
    )
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def write_jsonl(path, texts):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~300 generated documents of varied length, preprocessed; returns the dataset prefix."""
    d = tmp_path_factory.mktemp("corpus")
    texts = [f"doc {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(5 + i % 40)) + "\n"
             for i in range(300)]
    write_jsonl(d / "tiny.jsonl", texts)
    return ensure_preprocessed(str(d / "tiny.jsonl"))


def take(it, n):
    return [next(it) for _ in range(n)]


# --- tokenizers --------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = build_tokenizer(make_args())
    ids = tok.tokenize(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids + [tok.eod]) == text


def test_byte_tokenizer_vocab_and_padding():
    args = make_args()
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    assert args.padded_vocab_size == 384
    args = make_args(tensor_model_parallel_size=4, make_vocab_size_divisible_by=64)
    build_tokenizer(args)
    assert args.padded_vocab_size == 512


def test_null_tokenizer():
    args = make_args(tokenizer_type="NullTokenizer", vocab_size=1000)
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (1000, 999, 1024)
    assert tok.tokenize("3 1 4") == [3, 1, 4]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(NotImplementedError):
        build_tokenizer(make_args(tokenizer_type="GPT2BPETokenizer"))


# --- preprocess tool -----------------------------------------------------------------------
@pytest.mark.parametrize("name,workers", [("docs.jsonl", 1), ("docs.jsonl.gz", 2)])
def test_preprocess_round_trip(tmp_path, name, workers):
    write_jsonl(tmp_path / name, TEXTS)
    prefixes = preprocess_tool.preprocess_jsonl(
        str(tmp_path / name), str(tmp_path / "out"), append_eod=True, workers=workers, quiet=True)
    prefix = prefixes["text"]
    assert prefix == str(tmp_path / "out_text_document")
    ds = IndexedDataset(prefix)
    tok = build_tokenizer(make_args())
    kept = [t for t in TEXTS if t]
    assert len(ds) == len(kept)
    for i, text in enumerate(kept):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids) == text


def test_preprocess_cli(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", TEXTS)
    out = tmp_path / "c_text_document"  # a prefix with the suffix is used as is
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"),
                    "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(out),
                    "--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--workers", "1"],
                   check=True, capture_output=True)
    assert len(IndexedDataset(str(out))) == len([t for t in TEXTS if t])


# --- datasets --------------------------------------------------------------------------------
def check_batch(batch, args):
    mbs, seq = args.micro_batch_size, args.seq_length
    assert batch["tokens"].shape == (mbs, seq) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].shape == (mbs, seq) and batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].shape == (mbs, seq) and batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].shape == (mbs, seq)
    assert batch["attention_mask"].shape == (mbs, 1, seq, seq)
    assert batch["attention_mask"].dtype == torch.bool
    causal_masked = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    assert torch.equal(batch["attention_mask"][0, 0], causal_masked)  # True = masked out
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])  # labels shifted by one


def test_shipped_corpus_is_the_default_data(tmp_path):
    # data_path None and no mock data: the shipped corpus, tokenized on first use.
    args = make_args(data_path=None, split="969,30,1", data_cache_path=str(tmp_path),
                     seq_length=64)
    tok = build_tokenizer(args)
    train, valid, test = build_train_valid_test_data_iterators(args, tok, 0, 0)
    for batch in take(train, 3) + take(valid, 2) + take(test, 2):
        check_batch(batch, args)
    text = tok.detokenize(next(train)["tokens"][0].tolist())
    assert sum(c.isalpha() for c in text) > len(text) / 2  # real English, not noise


def global_batches(args, tok, consumed, dp_size, n):
    """n global batches from `consumed`, reassembled from dp_size simulated DP ranks."""
    per_rank = []
    for rank in range(dp_size):
        it, _, _ = build_train_valid_test_data_iterators(
            args, tok, consumed, 0, data_parallel_rank=rank, data_parallel_size=dp_size)
        steps = n * args.global_batch_size // (args.micro_batch_size * dp_size)
        per_rank.append([b["tokens"] for b in take(it, steps)])
    # step s of every rank together = samples [s*mbs*dp, (s+1)*mbs*dp) in rank order
    flat = [torch.cat([per_rank[r][s] for r in range(dp_size)]) for s in range(len(per_rank[0]))]
    return torch.cat(flat).view(n, args.global_batch_size, -1)


def test_resume_is_pure_function_of_consumed_samples(corpus, tmp_path):
    args = make_args(data_path=[corpus], data_cache_path=str(tmp_path / "a"))
    tok = build_tokenizer(args)
    k = 3
    full = global_batches(args, tok, 0, dp_size=2, n=6)
    resumed = global_batches(args, tok, k * args.global_batch_size, dp_size=2, n=6 - k)
    assert torch.equal(full[k:], resumed)
    # The DP size does not change which samples form a global batch.
    assert torch.equal(full, global_batches(args, tok, 0, dp_size=1, n=6))
    # A fresh cache directory (indices rebuilt, not loaded) gives the same order.
    args_b = make_args(data_path=[corpus], data_cache_path=str(tmp_path / "b"))
    assert torch.equal(full, global_batches(args_b, tok, 0, dp_size=2, n=6))
    # Another seed, another order.
    args_c = make_args(data_path=[corpus], data_cache_path=str(tmp_path / "a"), seed=4321)
    assert not torch.equal(full, global_batches(args_c, tok, 0, dp_size=2, n=6))


def test_valid_iterator_resumes_and_cycles(corpus, tmp_path):
    args = make_args(data_path=[corpus], data_cache_path=str(tmp_path))
    tok = build_tokenizer(args)
    _, valid, _ = build_train_valid_test_data_iterators(args, tok, 0, 0)
    first = [b["tokens"] for b in take(valid, 6)]
    _, valid2, _ = build_train_valid_test_data_iterators(args, tok, 0, 2 * args.micro_batch_size)
    assert all(torch.equal(a, b) for a, b in zip(first[2:], take_tokens(valid2, 4)))
    take(valid, 500)  # cycles instead of raising StopIteration


def take_tokens(it, n):
    return [b["tokens"] for b in take(it, n)]


def test_worker_processes_do_not_change_batches(corpus, tmp_path):
    args = make_args(data_path=[corpus], data_cache_path=str(tmp_path))
    tok = build_tokenizer(args)
    plain = take_tokens(build_train_valid_test_data_iterators(args, tok, 8, 0)[0], 4)
    args.num_workers = 2
    workers = take_tokens(build_train_valid_test_data_iterators(args, tok, 8, 0)[0], 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, workers))


def test_mock_data_with_null_tokenizer():
    args = make_args(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=500)
    tok = build_tokenizer(args)
    train, valid, test = build_train_valid_test_data_iterators(args, tok, 0, 0)
    for batch in take(train, 2) + take(valid, 1) + take(test, 1):
        check_batch(batch, args)
        assert int(batch["tokens"].max()) < tok.vocab_size
    first = take_tokens(build_train_valid_test_data_iterators(args, tok, 0, 0)[0], 3)
    again = take_tokens(build_train_valid_test_data_iterators(args, tok, 0, 0)[0], 3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_poisoned_samples_follow_the_sample_not_the_position():
    """--poison-train-samples: the poisoned sample's loss mask is NaN whenever it is read
    (from the start, or resumed at its batch), every other sample is untouched."""
    args = make_args(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=500)
    tok = build_tokenizer(args)
    clean = take(build_train_valid_test_data_iterators(args, tok, 0, 0)[0], 8)
    args.poison_train_samples = "10-10"  # global batch 1 (samples 8-15), micro-batch 1
    for consumed in (0, 8):
        got = take(build_train_valid_test_data_iterators(args, tok, consumed, 0)[0], 2)
        want = clean[consumed // 2:consumed // 2 + 2]
        for i, (a, b) in enumerate(zip(got, want)):
            sample = consumed + 2 * i  # the micro-batch's first sample
            assert torch.equal(a["tokens"], b["tokens"])
            poisoned = [sample + j == 10 for j in range(2)]
            assert [bool(torch.isnan(m).all()) for m in a["loss_mask"]] == poisoned
            assert torch.equal(a["loss_mask"][[not p for p in poisoned]],
                               b["loss_mask"][[not p for p in poisoned]])
    assert parse_sample_ranges("3-3,10-12") == [(3, 3), (10, 12)]
    with pytest.raises(ValueError, match="FIRST-LAST"):
        parse_sample_ranges("10-12,12-10")


def test_empty_split_is_an_error(tmp_path):
    write_jsonl(tmp_path / "few.jsonl", ["some text " * 20] * 5)
    prefix = ensure_preprocessed(str(tmp_path / "few.jsonl"))
    args = make_args(data_path=[prefix], split="969,30,1", data_cache_path=str(tmp_path))
    with pytest.raises(ValueError, match="no documents"):
        build_train_valid_test_data_iterators(args, build_tokenizer(args), 0, 0)


def test_ensure_preprocessed_rebuilds_when_source_changes(tmp_path):
    src = tmp_path / "c.jsonl.gz"
    write_jsonl(src, ["one"])
    prefix = ensure_preprocessed(str(src))
    assert prefix == str(tmp_path / "c_text_document") and ensure_preprocessed(prefix) == prefix
    write_jsonl(src, ["one", "two"])
    os.utime(src, (os.path.getmtime(prefix + ".idx") + 10,) * 2)
    ensure_preprocessed(prefix)
    assert len(IndexedDataset(prefix)) == 2


@settings(max_examples=50, deadline=None)
@given(total=st.integers(1, 200), consumed=st.integers(0, 200), mbs=st.integers(1, 4),
       dp=st.integers(1, 4))
def test_sampler_slices_partition_global_order(total, consumed, mbs, dp):
    ranks = [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    merged = [i for step in zip(*ranks) for batch in step for i in batch]
    steps = max(total - consumed, 0) // (mbs * dp)
    assert merged == list(range(consumed, consumed + steps * mbs * dp))


# --- 4 ranks, gloo: megatron-core builds the cache on rank 0, the others wait and load it ----
WORKER = textwrap.dedent("""
    import argparse, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.training.tokenizer import build_tokenizer
    from megatron.training.data import build_train_valid_test_data_iterators
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    ps.initialize_model_parallel()
    args = argparse.Namespace(**{args!r})
    tok = build_tokenizer(args)
    train, _, _ = build_train_valid_test_data_iterators(args, tok, {consumed}, 0)
    torch.save([next(train)["tokens"] for _ in range(2)], os.path.join({out!r}, f"rank{{rank}}.pt"))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
""")


# slow tier (make test's budget): every multi-rank training test shares one cache too
@pytest.mark.slow
def test_four_gloo_ranks_share_one_cache(corpus, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    args = make_args(data_path=[corpus], data_cache_path=str(cache), global_batch_size=8)
    consumed = 2 * args.global_batch_size
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=REPO_ROOT, port=port, args=vars(args), out=str(tmp_path),
                                    consumed=consumed))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(4)]
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    # One set of indices (train/valid/test x description + 3 .npy) in one fingerprint directory.
    (fp_dir,) = list(cache.iterdir())
    assert len(list(fp_dir.iterdir())) == 12
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    got = torch.cat([torch.cat([per_rank[r][s] for r in range(4)]) for s in range(2)])
    expected = global_batches(args, build_tokenizer(args), consumed, dp_size=1, n=2)
    assert torch.equal(got.view(2, args.global_batch_size, -1), expected)
