"""tools/convert_checkpoint.py against transformers itself: a checkpoint the trainer saved
(PP 2, ZeRO-1, the shipped corpus, the byte-level tokenizer) becomes a directory that
``AutoModelForCausalLM``/``AutoTokenizer`` load, whose logits equal the trainer's forward
on the same text and whose tokenizer gives the trainer's ids (the newest checkpoint
corrupted: the older one); a Hugging Face Llama goes to torch_dist and back bit for bit,
with its own tokenizer; the trainer fine-tunes from it at another TP/PP, and refuses shape
flags that differ from the model's by name."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.harness.run import ENV_PATH, REPO, torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

CORPUS = os.path.join(REPO, "data", "pd_english.jsonl.gz")
VERIFY = re.compile(r"max \|logit difference\| (\S+) .*loss trainer (\S+) \(vocabulary "
                    r"(\d+)\), transformers (\S+) \(vocabulary (\d+)\)")


def convert(*args: str, warnings: str = "ignore") -> str:
    env = dict(os.environ, PYTHONWARNINGS=warnings, **ENV_PATH)
    if not warnings:  # as in a user's shell
        env.pop("PYTHONWARNINGS")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/convert_checkpoint.py"),
                           *args], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def verified(out: str) -> tuple[float, float, float]:
    m = VERIFY.search(out)
    assert m, out[-3000:]
    return float(m.group(1)), float(m.group(2)), float(m.group(4))


def test_trained_checkpoint_loads_in_transformers_with_the_trainers_logits(tmp_path):
    run = torchrun(2, ["--model-size", "tiny", "--pipeline-model-parallel-size", "2",
                       "--use-distributed-optimizer", "--micro-batch-size", "4",
                       "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3",
                       "--log-interval", "3", "--eval-interval", "1000", "--eval-iters", "0",
                       "--save", str(tmp_path / "ckpt"), "--save-interval", "3"])
    run.check()
    newest = os.path.join(run.checkpoint, "iter_0000006")
    shard = _flip_a_byte(newest)  # the newest refused, the older one converted
    out_dir = str(tmp_path / "hf")
    out = convert("--to", "hf", "--load", run.checkpoint, "--output", out_dir, "--verify",
                  warnings="")
    # only [convert] lines: no library warning, no progress bar (issue 52)
    assert all(line.startswith("[convert] ") for line in out.splitlines()), out
    assert f"checkpoint {newest} refused: {newest}/{shard}: SHA-256 differs" in out, out
    assert f"converting {run.checkpoint}/iter_0000003 instead" in out, out
    diff, loss_trainer, loss_hf = verified(out)
    assert diff < 1e-4  # fp32 both sides: rounding only
    assert abs(loss_trainer - loss_hf) < 1e-5  # a trained model keeps its padded vocabulary

    from megatron.training.tokenizer import ByteLevelTokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out_dir)
    text = "It was the best of times, it was the worst of times — naïve café."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ByteLevelTokenizer().tokenize(text) and tok.decode(ids) == text
    with torch.no_grad():
        sample = model.generate(torch.tensor([ids[:8]]), max_new_tokens=8, do_sample=False)
    assert sample.shape == (1, 16) and isinstance(tok.decode(sample[0]), str)
    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    assert (cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (2, False)


def _flip_a_byte(ckpt_dir: str) -> str:
    """One flipped bit in the first .distcp shard of a checkpoint; its name."""
    shard = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".distcp"))[0]
    with open(os.path.join(ckpt_dir, shard), "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    return shard


def _random_hf_llama(path: str, tied: bool = False) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500000.0,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norms away from ones, so a swapped norm would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path, safe_serialization=True)


@pytest.mark.slow  # two conversions; the default tier: the fallback in the test above, the
# SentencePiece export in tests/unit/test_hf_refusals.py
def test_import_keeps_its_tokenizer_and_export_takes_the_newest_verified_checkpoint(tmp_path):
    """A Hugging Face Llama with a SentencePiece tokenizer (the export of a
    SentencePieceTokenizer job) imported, its checkpoint's newest iteration corrupted: the
    export refuses that one, converts the older one, bit for bit, with the model's own
    tokenizer (not the byte-level default), which transformers uses like the trainer."""
    import shutil

    import sentencepiece
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from megatron.training.hf_tokenizer import sentencepiece_tokenizer
    from megatron.training.tokenizer import SentencePieceTokenizer

    sp = str(tmp_path / "sp.model")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(80), f)]
    with open(sp, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(docs), model_writer=f, vocab_size=300, model_type="bpe",
            minloglevel=2, max_sentence_length=1 << 16)
    src, ckpt, back = (str(tmp_path / n) for n in ("src", "ckpt", "back"))
    _random_hf_llama(src)  # vocabulary 300
    sentencepiece_tokenizer(sp).save_pretrained(src)
    convert("--to", "megatron", "--hf-model", src, "--save", ckpt)
    # a newer iteration whose shard is corrupted, named by the tracker
    newer = os.path.join(ckpt, "iter_0000003")
    shutil.copytree(os.path.join(ckpt, "iter_0000000"), newer)
    shard = _flip_a_byte(newer)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    out = convert("--to", "hf", "--load", ckpt, "--output", back, "--verify")
    assert f"checkpoint {newer} refused: {newer}/{shard}: SHA-256 differs" in out, out
    assert f"converting {ckpt}/iter_0000000 instead" in out, out
    assert "tokenizer HuggingFaceTokenizer" in out and verified(out)[0] < 1e-4, out
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (src, back))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    tok, mine = AutoTokenizer.from_pretrained(back), SentencePieceTokenizer(sp)
    text = "And God said, Let there be light: and there was light."
    assert tok(text)["input_ids"] == mine.tokenize(text) and tok.eos_token_id == mine.eod
    assert tok.decode(mine.tokenize(text)) == text


@pytest.mark.slow  # make test's 12 minutes; the default tier's round trip is the mapping's
# (tests/unit/test_hf_llama.py), the conversion itself the trained-checkpoint test above
def test_hugging_face_to_torch_dist_and_back_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    src, ckpt, back = (str(tmp_path / n) for n in ("src", "ckpt", "back"))
    _random_hf_llama(src)
    diff, _, _ = verified(convert("--to", "megatron", "--hf-model", src, "--save", ckpt,
                                  "--verify"))
    assert diff < 1e-4
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "0"
    assert os.path.isfile(os.path.join(ckpt, "iter_0000000", "integrity.json"))  # sealed
    convert("--to", "hf", "--load", ckpt, "--output", back, "--tokenizer-type", "NullTokenizer")
    a, b = load_file(os.path.join(src, "model.safetensors")), \
        load_file(os.path.join(back, "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (src, back))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):
        assert ca[key] == cb[key], key
    assert cb["rope_parameters"]["rope_theta"] == ca["rope_parameters"]["rope_theta"] == 5e5
    # nothing is overwritten
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--to", "megatron",
                           "--hf-model", src, "--save", ckpt], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, **ENV_PATH))
    assert proc.returncode == 2 and "already holds a checkpoint" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # six trainer starts and two conversions
def test_finetune_from_hugging_face_at_tp2_pp2_and_back(tmp_path):
    src, ckpt, back = (str(tmp_path / n) for n in ("src", "ckpt", "back"))
    _random_hf_llama(src, tied=True)  # tied embeddings are untied: same function
    convert("--to", "megatron", "--hf-model", src, "--save", ckpt,
            "--target-tensor-parallel-size", "2")
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--ffn-hidden-size", "160", "--seq-length", "64",
             "--rotary-base", "500000", "--norm-epsilon", "1e-6", "--bf16", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
             "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "1000",
             "--eval-iters", "0", "--use-distributed-optimizer", "--load", ckpt]
    refused = torchrun(1, model)
    assert refused.returncode != 0 and "add --finetune" in refused.output

    def swap(flag, value):
        out = list(model)
        out[out.index(flag) + 1] = value
        return out + ["--finetune"]
    # shape flags that differ from the model's: one line naming the flag, no traceback
    for flag, wrong, right in (("--rotary-base", "10000", "500000"),
                               ("--num-query-groups", "4", "2")):
        refused = torchrun(1, swap(flag, wrong))
        assert refused.returncode != 0 and f"give {flag} {right}" in refused.output, \
            refused.output[-3000:]
        # (torchrun's agent prints its own ChildFailedError traceback; the rank: none)
        assert "CheckpointException" not in refused.output and \
            'checkpointing.py", line' not in refused.output, refused.output[-3000:]
    # converted for TP 2 (300 -> 512 rows), loaded at TP 1 (384): the flag that fits
    refused = torchrun(1, model + ["--finetune"])
    assert refused.returncode != 0 and "add --make-vocab-size-divisible-by 256 or convert " \
        "again with --target-tensor-parallel-size 1" in refused.output, refused.output[-3000:]
    run = torchrun(4, model + ["--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2", "--finetune",
                               "--save", str(tmp_path / "tuned")])
    run.check()
    assert "weights only, --finetune: iteration 0" in run.output
    diff, loss_trainer, loss_hf = verified(convert("--to", "hf", "--load", run.checkpoint,
                                                   "--output", back, "--verify"))
    assert diff < 1e-4 and abs(loss_trainer - loss_hf) < 1e-5
