"""What a newcomer hits around the Hugging Face conversion, each refused in one line naming
the flag or file (issue 52): a fine-tune whose shape flags differ from the checkpoint's
(--rotary-base, --norm-epsilon, --num-query-groups), a vocabulary padded for another TP
(the flag that reproduces it), the converter's bad paths and files; and a SentencePiece
job's tokenizer exported so that transformers encodes and decodes like the trainer, with
--verify refusing a tokenizer that encodes text to nothing. No process group: the
converter's runs are in tests/integration/test_hf_convert.py."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from tests.harness.run import REPO

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import MODEL_FIELDS, CheckpointError, Checkpointer
from megatron.training.hf_llama import ConversionError
from megatron.training.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

CORPUS = os.path.join(REPO, "data", "pd_english.jsonl.gz")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--ffn-hidden-size", "160", "--seq-length", "64", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--train-iters", "1"]
SAMPLES = ["And God said, Let there be light: and there was light.\n",
           "  leading, double  spaces and a trailing tab\t", "naïve café ∑ — ok",
           "ﬁne print 12,345 x² (unknown: 日本)"]


def _args(*extra: str, world: int = 1, data=("--mock-data",)):
    args = parse_args([*MODEL, *data, *extra], world_size=world)
    build_tokenizer(args)  # sets padded_vocab_size, as the trainer does
    return args


def _saved(args, **over) -> dict:
    """The checkpoint's args as sharded_state_dict records them."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers",
            "hidden_size", "padded_vocab_size", "data_parallel_size", *MODEL_FIELDS)
    return {**{k: getattr(args, k, None) for k in keys}, **over}


def _check(args, saved: dict, finetune: bool = True) -> None:
    ck = Checkpointer.__new__(Checkpointer)  # _check_layout reads only the args
    ck.args = args
    ck._check_layout(saved, "ckpt/iter_0000000", finetune)


IMPORTED = {"imported_from": "huggingface", "hf_vocab_size": 300, "num_query_groups": 2,
            "rotary_base": 500000.0, "norm_epsilon": 1e-6}


def test_finetune_names_each_shape_flag_that_differs_from_the_checkpoint():
    right = _args("--num-query-groups", "2", "--rotary-base", "500000", "--norm-epsilon",
                  "1e-6", "--vocab-size", "300", "--tokenizer-type", "NullTokenizer")
    saved = _saved(right, **IMPORTED)
    _check(right, saved)  # the model's own flags load
    wrong = _args("--num-query-groups", "2", "--vocab-size", "300", "--tokenizer-type",
                  "NullTokenizer")  # the trainer's defaults: rope 10000, eps 1e-5
    with pytest.raises(CheckpointError) as err:
        _check(wrong, saved)
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("give --rotary-base 500000 --norm-epsilon 1e-06"), msg
    assert "this run has --rotary-base 10000, --norm-epsilon 1e-05" in msg, msg
    groups = _args("--num-query-groups", "4", "--rotary-base", "500000", "--norm-epsilon",
                   "1e-6", "--vocab-size", "300", "--tokenizer-type", "NullTokenizer")
    with pytest.raises(CheckpointError, match=r"saved with --num-query-groups 2; this run "
                                              r"has --num-query-groups 4: give "
                                              r"--num-query-groups 2$"):
        _check(groups, saved)
    # no --num-query-groups: one group per head, as megatron-core builds it
    plain = _args("--vocab-size", "300", "--tokenizer-type", "NullTokenizer")
    _check(plain, _saved(plain, num_query_groups=4))
    # a checkpoint saved before these fields were recorded: not compared
    _check(plain, {k: v for k, v in _saved(plain).items() if k not in MODEL_FIELDS})


def test_vocabulary_padded_for_another_tp_names_the_flag_that_reproduces_it():
    tp2 = _args("--tensor-model-parallel-size", "2", world=2)  # byte-level: 258 -> 512
    assert tp2.padded_vocab_size == 512
    tp1 = _args()
    assert tp1.padded_vocab_size == 384
    with pytest.raises(CheckpointError) as err:
        _check(tp1, _saved(tp2))
    msg = str(err.value)
    assert "--padded-vocab-size" not in msg and msg.endswith(
        "(--make-vocab-size-divisible-by 128 x --tensor-model-parallel-size 1): add "
        "--make-vocab-size-divisible-by 256"), msg
    fixed = _args("--make-vocab-size-divisible-by", "256")  # the advice works
    _check(fixed, _saved(tp2))
    # an import: either flag (convert again for this TP, or the divisor)
    imported = _args("--vocab-size", "300", "--tokenizer-type", "NullTokenizer")
    with pytest.raises(CheckpointError, match=r"add --make-vocab-size-divisible-by 256 or "
                                              r"convert again with "
                                              r"--target-tensor-parallel-size 1$"):
        _check(imported, _saved(imported, imported_from="huggingface", hf_vocab_size=300,
                                padded_vocab_size=512))


# --- the SentencePiece export -------------------------------------------------------
@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(100), f)]
    path = str(tmp_path_factory.mktemp("sp") / "tiny.model")
    with open(path, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(docs), model_writer=f, vocab_size=300, model_type="bpe",
            pad_id=3, minloglevel=2, max_sentence_length=1 << 16)
    return path


def test_sentencepiece_job_exports_a_tokenizer_transformers_uses_like_the_trainer(
        sp_model, tmp_path):
    from transformers import AutoTokenizer

    from megatron.training import hf_tokenizer
    from megatron.training.tokenizer import SentencePieceTokenizer

    ids = hf_tokenizer.export("SentencePieceTokenizer", sp_model, str(tmp_path))
    mine = SentencePieceTokenizer(sp_model)
    assert ids == {"bos_token_id": 1, "eos_token_id": mine.eod, "pad_token_id": 3}
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 300 and tok.eos_token_id == mine.eod
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        tail = [json.loads(line)["text"] for line in f][-3:]  # unseen in training
    for text in SAMPLES + tail:
        got = tok(text)["input_ids"]  # add_special_tokens too: the trainer adds none
        assert got == mine.tokenize(text) and len(got) > len(text) // 8, text[:60]
        assert tok.decode(got) == mine.detokenize(got), text[:60]


def test_verify_refuses_a_tokenizer_that_encodes_text_to_nothing(sp_model, tmp_path):
    from transformers import LlamaTokenizer

    from megatron.training.hf_checkpoint import _verify_tokens

    # what the export wrote before (transformers 5: 3 pieces, every text encodes to [])
    LlamaTokenizer(vocab_file=sp_model, add_bos_token=False).save_pretrained(str(tmp_path))
    with pytest.raises(ConversionError, match=r"^--verify: the tokenizer in .* encodes \d+ "
                                              r"characters of the corpus to \[\]: it is "
                                              r"broken"):
        _verify_tokens(str(tmp_path), None, 300, 64)
    empty = tmp_path / "none"
    empty.mkdir()  # no tokenizer at all (a mock-data model): seeded random ids
    assert _verify_tokens(str(empty), None, 300, 64).shape == (1, 64)


# --- the converter's bad paths and files: one line, exit 2, before any work -------------
def _convert(capsys, *argv: str) -> str:
    from tools.convert_checkpoint import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert_checkpoint: "), err
    return err


def test_converter_refuses_bad_paths_and_files_in_one_line(tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert f"--output {afile} is a file" in _convert(
        capsys, "--to", "hf", "--load", str(ckpt), "--output", str(afile))
    assert "--save " + str(afile) + " is a file" in _convert(
        capsys, "--to", "megatron", "--hf-model", str(tmp_path), "--save", str(afile))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert "config.json cannot be read" in _convert(
        capsys, "--to", "megatron", "--hf-model", str(hf), "--save", str(tmp_path / "o1"))
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 48, "vocab_size": 16}))
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(32)}, str(hf / "model.safetensors"))
    blob = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(blob[:len(blob) - 40])  # a cut-off copy
    err = _convert(capsys, "--to", "megatron", "--hf-model", str(hf), "--save",
                   str(tmp_path / "o2"))
    assert "model.safetensors cannot be read" in err and "truncated" in err, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
