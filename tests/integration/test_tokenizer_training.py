"""The whole tokenizer path end to end, with the commands a user types: train a BPE
(tools/train_tokenizer.py), tokenize a corpus with it (tools/preprocess_data.py --workers 2),
and train the tiny Llama on 2 gloo ranks with --tokenizer-type HuggingFaceTokenizer: the
loss is finite and falls; the checkpoint converts to Hugging Face with that tokenizer
(tools/convert_checkpoint.py) and transformers decodes the model's samples with it."""

import gzip
import itertools
import math
import os
import subprocess
import sys

import pytest

from tests.harness.run import ENV_PATH, REPO, TINY, torchrun

CORPUS = os.path.join(REPO, "data", "pd_english.jsonl.gz")
ITERS = 30


def _tiny_without_mock_data():
    """TINY's model and schedule flags, without its mock data and null tokenizer."""
    args, skip = [], 0
    for i, a in enumerate(TINY):
        if skip:
            skip -= 1
            continue
        if a == "--mock-data":
            continue
        if a in ("--tokenizer-type", "--vocab-size"):
            skip = 1
            continue
        args.append(a)
    return args


def _run(cmd):
    env = dict(os.environ, REFT_NO_PROGRESS="1", **ENV_PATH)
    out = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
def test_train_on_bpe_tokenized_corpus(tmp_path):
    bpe = str(tmp_path / "bpe")
    _run(["tools/train_tokenizer.py", "--output", bpe, "--vocab-size", "1024",
          "--max-documents", "400"])
    src = tmp_path / "slice.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        src.write_text("".join(itertools.islice(f, 300)), encoding="utf-8")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe]
    _run(["tools/preprocess_data.py", "--input", str(src), "--output-prefix",
          str(tmp_path / "slice"), "--append-eod", "--workers", "2", *flags])
    prefix = str(tmp_path / "slice_text_document")
    res = torchrun(2, [*_tiny_without_mock_data(), *flags, "--data-path", prefix,
                       "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache"),
                       "--train-iters", str(ITERS), "--global-batch-size", "8",
                       "--lr", "3e-3", "--lr-warmup-iters", "3"], timeout=600).check()
    losses = [float.fromhex(res.losses[i]) for i in sorted(res.losses)]
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses), losses
    # from ln(1024) ~ 6.9 down: the model learns the BPE-tokenized text
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses

    hf = str(tmp_path / "hf")
    out = _run(["tools/convert_checkpoint.py", "--to", "hf", "--load", res.checkpoint,
                "--output", hf, "--verify"])
    assert "tokenizer HuggingFaceTokenizer" in out.stdout and "within" in out.stdout, out.stdout
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.training.tokenizer import HuggingFaceTokenizer

    tok, mine = AutoTokenizer.from_pretrained(hf), HuggingFaceTokenizer(bpe)
    text = "It was the best of times, it was the worst of times"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == mine.tokenize(text) and tok.eos_token_id == mine.eod
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        sample = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    words = tok.decode(sample[0][len(ids):], skip_special_tokens=True)
    assert isinstance(words, str) and words.strip(), words
