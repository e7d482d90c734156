"""Real tokenizers from local files: a byte-level BPE trained by tools/train_tokenizer.py
(loaded by transformers exactly as the trainer uses it), a SentencePiece model, the
preprocessor's worker pool, and the refusals (flags, and data sets made with another
tokenizer) naming the flag to change.

Tiny on purpose (the default tier's budget): a 512-token BPE on 150 documents of the shipped
corpus, a 300-piece SentencePiece model, 40 documents preprocessed.
"""

import argparse
import gzip
import importlib.util
import itertools
import json
import os
import pickle
import shutil
import sys

import pytest

from tests.harness.run import REPO

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training import data as data_mod  # noqa: E402
from megatron.training import dataset_files  # noqa: E402
from megatron.training.arguments import ArgumentError, parse_args  # noqa: E402
from megatron.training.tokenizer import TokenizerError, build_tokenizer  # noqa: E402
from megatron.training.tokenizer_files import read_dataset_tokenizer_info  # noqa: E402

CORPUS = os.path.join(REPO, "data", "pd_english.jsonl.gz")
HF, SP = "HuggingFaceTokenizer", "SentencePieceTokenizer"
SAMPLES = ["And God said, Let there be light: and there was light.\n",
           "  leading, double  spaces and a trailing tab\t", "naïve café ∑ 😀 — ok", ""]
preprocess_tool = dataset_files._load_preprocess_tool()


def _load_train_tool():
    spec = importlib.util.spec_from_file_location(
        "_train_tokenizer_tool", os.path.join(REPO, "tools", "train_tokenizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_tool = _load_train_tool()


def tok_args(kind, model=None, **kw):
    return argparse.Namespace(tokenizer_type=kind, tokenizer_model=model, vocab_size=None,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                              **kw)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bpe"))
    tok = train_tool.train_bpe(train_tool.iter_texts(CORPUS, max_documents=150), vocab_size=512)
    train_tool.save_tokenizer_dir(tok, out)
    return out


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece

    path = str(tmp_path_factory.mktemp("sp") / "tiny.model")
    with open(path, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=train_tool.iter_texts(CORPUS, max_documents=100), model_writer=f,
            vocab_size=300, model_type="bpe", pad_id=3, minloglevel=2,
            max_sentence_length=1 << 16)  # whole documents, not lines
    return path


@pytest.fixture(scope="module")
def slice_jsonl(tmp_path_factory):
    """The corpus's first 40 documents and one with non-ASCII text, as plain JSONL."""
    path = tmp_path_factory.mktemp("slice") / "slice.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        lines = list(itertools.islice(f, 40))
    lines.append(json.dumps({"text": SAMPLES[2]}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def preprocess(src, prefix, kind, model, workers=1):
    return preprocess_tool.preprocess_jsonl(src, prefix, tokenizer_type=kind,
                                            tokenizer_model=model, append_eod=True,
                                            workers=workers, quiet=True)["text"]


# --- the trained BPE, through transformers and through the trainer ---------------------------
def test_trained_bpe_is_what_transformers_loads(bpe_dir, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(bpe_dir, local_files_only=True)
    eod, pad = train_tool.EOD_TOKEN, train_tool.PAD_TOKEN
    assert (auto.eos_token, auto.bos_token, auto.pad_token) == (eod, eod, pad)
    # the directory and its bare tokenizer.json (alone, or alone in a directory) give the
    # same tokenizer: without a tokenizer_config.json eod/pad are found by name
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(os.path.join(bpe_dir, "tokenizer.json"), alone)
    for model in (bpe_dir, os.path.join(bpe_dir, "tokenizer.json"), str(alone)):
        args = tok_args(HF, model)
        tok = build_tokenizer(args)
        assert (tok.vocab_size, tok.eod, tok.pad, args.padded_vocab_size) == (512, 0, 1, 512)
        for text in SAMPLES:
            ids = tok.tokenize(text)
            assert ids == auto(text).input_ids == raw.encode(text).ids
            assert tok.detokenize(ids) == auto.decode(ids) == text  # byte-level: lossless
        assert pickle.loads(pickle.dumps(tok)).tokenize(SAMPLES[2]) == tok.tokenize(SAMPLES[2])
    tok.save_pretrained(str(tmp_path / "saved"))  # what a checkpoint converter writes
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    assert (saved.eos_token_id, saved.pad_token_id) == (0, 1)


def test_identity_is_the_files_content(bpe_dir, tmp_path):
    tok = build_tokenizer(tok_args(HF, bpe_dir))
    copy = shutil.copytree(bpe_dir, tmp_path / "copy")
    assert build_tokenizer(tok_args(HF, str(copy))).unique_identifiers == tok.unique_identifiers
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write(" ")  # any change to the tokenizer's files: another identity, other caches
    other = build_tokenizer(tok_args(HF, str(copy)))
    assert other.unique_identifiers["sha256"] != tok.unique_identifiers["sha256"]


def test_train_tokenizer_cli(tmp_path):
    import subprocess

    tool = os.path.join(REPO, "tools", "train_tokenizer.py")
    out = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--vocab-size" in out.stdout and "--output" in out.stdout
    out = subprocess.run([sys.executable, tool, "--output", str(tmp_path / "t"), "--vocab-size",
                          "300", "--max-documents", "30"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "300 tokens" in out.stderr and "--tokenizer-model" in out.stderr
    assert sorted(os.listdir(tmp_path / "t")) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


# --- SentencePiece -----------------------------------------------------------------------------
def test_sentencepiece_through_the_trainer(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    args = tok_args(SP, sp_model)
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (300, sp.eos_id(), 3, sp.bos_id())
    assert args.padded_vocab_size == 384
    for text in SAMPLES:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text)
        assert tok.detokenize(ids + [tok.eod]) == sp.decode(ids)
    assert pickle.loads(pickle.dumps(tok)).tokenize(SAMPLES[0]) == tok.tokenize(SAMPLES[0])


# --- preprocessing ------------------------------------------------------------------------------
def test_preprocess_workers_byte_identical(bpe_dir, slice_jsonl, tmp_path):
    one = preprocess(slice_jsonl, str(tmp_path / "w1"), HF, bpe_dir, workers=1)
    two = preprocess(slice_jsonl, str(tmp_path / "w2"), HF, bpe_dir, workers=2)
    for ext in (".bin", ".idx", ".tokenizer-info.json"):
        with open(one + ext, "rb") as a, open(two + ext, "rb") as b:
            assert a.read() == b.read(), ext
    info = read_dataset_tokenizer_info(one)
    assert info["identity"]["tokenizer_type"] == HF and info["vocab_size"] == 512
    assert info["tokenizer_model"] == os.path.abspath(bpe_dir)
    tok, ds = build_tokenizer(tok_args(HF, bpe_dir)), IndexedDataset(one)
    last = ds[len(ds) - 1].tolist()
    assert last[-1] == tok.eod and tok.detokenize(last[:-1]) == SAMPLES[2]


def test_preprocess_cli_names_the_flag(slice_jsonl, tmp_path, capsys):
    for argv, flag in ((["--tokenizer-type", HF], "--tokenizer-model"),
                       (["--tokenizer-type", SP, "--tokenizer-model", slice_jsonl],
                        "--tokenizer-model")):
        with pytest.raises(SystemExit) as err:
            preprocess_tool.main(["--input", slice_jsonl, "--output-prefix",
                                  str(tmp_path / "x"), *argv])
        assert flag in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing written


# --- refusals -----------------------------------------------------------------------------------
def test_bad_tokenizer_flags_name_the_flag(tmp_path, slice_jsonl, sp_model, bpe_dir):
    data = ["--data-path", str(tmp_path / "none_text_document")]
    cases = [
        (["--tokenizer-type", HF, *data], "--tokenizer-model"),
        (["--tokenizer-type", HF, "--tokenizer-model", str(tmp_path / "missing"), *data],
         "--tokenizer-model"),
        (["--tokenizer-type", HF, "--tokenizer-model", str(tmp_path), *data],
         "--tokenizer-model"),  # a directory without tokenizer files
        (["--tokenizer-type", HF, "--tokenizer-model", slice_jsonl, *data],
         "--tokenizer-model"),  # not JSON
        (["--tokenizer-type", SP, "--tokenizer-model", slice_jsonl, *data],
         "--tokenizer-model"),
        (["--tokenizer-type", SP, "--tokenizer-model", os.path.dirname(sp_model), *data],
         "--tokenizer-model"),
        (["--tokenizer-model", bpe_dir, *data], "--tokenizer-model"),  # byte-level: unused
        (["--tokenizer-type", HF, "--tokenizer-model", bpe_dir], "--data-path"),  # default data
    ]
    for argv, flag in cases:
        with pytest.raises(ArgumentError) as err:
            parse_args(argv, world_size=1)
        assert str(err.value).startswith(flag + ":"), (argv, str(err.value))
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer(tok_args(HF, str(tmp_path / "missing")))


def test_dataset_of_another_tokenizer_is_refused(bpe_dir, sp_model, slice_jsonl, tmp_path):
    prefix = preprocess(slice_jsonl, str(tmp_path / "bpe"), HF, bpe_dir)
    hf = ["--tokenizer-type", HF, "--tokenizer-model", bpe_dir]
    parse_args(["--data-path", prefix, *hf], world_size=1)  # its own tokenizer: accepted
    for other in ([], ["--tokenizer-type", SP, "--tokenizer-model", sp_model]):
        with pytest.raises(ArgumentError) as err:
            parse_args(["--data-path", prefix, *other], world_size=1)
        msg = str(err.value)
        assert msg.startswith("--data-path:") and f"--tokenizer-type {HF}" in msg, msg
    # and when the datasets are built (every data path, e.g. per split, set programmatically)
    args = argparse.Namespace(**vars(tok_args("ByteLevelTokenizer")), data_path=[prefix],
                              mock_data=False, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(TokenizerError, match="--tokenizer-type HuggingFaceTokenizer"):
        data_mod.build_train_valid_test_datasets(args, build_tokenizer(args))
    # a dataset with no record (Megatron-LM's tool): ids past the vocabulary give it away
    os.remove(prefix + ".tokenizer-info.json")
    with pytest.raises(TokenizerError, match="outside this tokenizer's vocabulary of 258"):
        dataset_files.check_dataset_tokenizer([prefix], build_tokenizer(args))
    # ensure_preprocessed never overwrites another tokenizer's data set with byte-level ids
    src = tmp_path / "corpus.jsonl"
    shutil.copy(slice_jsonl, src)
    made = preprocess(str(src), str(tmp_path / "corpus"), HF, bpe_dir)
    os.utime(src, (os.path.getmtime(made + ".idx") + 10,) * 2)  # the corpus changed since
    with pytest.raises(TokenizerError, match="--data-path"):
        dataset_files.ensure_preprocessed(made)
