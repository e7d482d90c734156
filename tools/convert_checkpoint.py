"""Convert between this trainer's torch_dist checkpoints and Hugging Face Llama directories.

    python tools/convert_checkpoint.py --to hf --load CKPT --output HF_DIR [--verify]
    python tools/convert_checkpoint.py --to megatron --hf-model HF_DIR --save CKPT [--verify]

``--to hf`` reads the newest verified checkpoint of ``--load`` (or ``--iteration N``;
a directory another user can write is refused as the trainer refuses it, unless
``--trust-shared-checkpoint-dir``),
saved at any TP/PP/VPP, with or without ZeRO-1 (only the model weights are read:
megatron-core's dist_checkpointing reshards them into one process), and writes
``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer the
job trained with (byte-level: a ``tokenizer.json`` transformers loads; a
``--tokenizer-type HuggingFaceTokenizer``/``SentencePieceTokenizer`` job: its own files).

``--to megatron`` writes ``CKPT/iter_0000000`` (weights only, sealed with checksums) that
the trainer loads at any ``--pipeline-model-parallel-size`` and at the
``--target-tensor-parallel-size`` it was converted for (the vocabulary padding depends on
TP, as in Megatron-LM) with ``--load CKPT --finetune`` (Megatron's flag: weights only, fresh optimizer, iteration
0), and the Hugging Face tokenizer files beside it (``CKPT/tokenizer``).

``--verify`` runs both models in fp32 on the same tokens (``--verify-text`` or the shipped
corpus's first validation documents) and prints the largest logit difference and the two
losses; exit 1 when the logits differ by more than ``--tolerance``. Mapping:
megatron/training/hf_llama.py; docs/huggingface.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", choices=["hf", "megatron"], required=True,
                   help="hf: torch_dist -> Hugging Face; megatron: Hugging Face -> torch_dist")
    p.add_argument("--load", help="--to hf: the checkpoint root (the trainer's --save)")
    p.add_argument("--trust-shared-checkpoint-dir", action="store_true",
                   help="--to hf: read a --load that another user can write (the trainer's "
                        "flag: a checkpoint's metadata is a pickle, loading it runs what it "
                        "holds); without it such a directory is refused")
    p.add_argument("--iteration", type=int, default=None,
                   help="--to hf: this iteration instead of the tracker's newest")
    p.add_argument("--output", help="--to hf: the Hugging Face directory to write")
    p.add_argument("--hf-model", help="--to megatron: a Hugging Face Llama directory")
    p.add_argument("--save", help="--to megatron: the checkpoint root to write")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--to megatron: the trainer's vocabulary padding (same flag)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="--to megatron: the TP the trainer will load it at; the vocabulary "
                        "is padded as the trainer pads it there (a multiple of "
                        "--make-vocab-size-divisible-by x TP)")
    p.add_argument("--tokenizer-type", default=None,
                   help="--to hf: override the tokenizer the checkpoint records")
    p.add_argument("--tokenizer-model", default=None,
                   help="--to hf: override the tokenizer file/directory it records")
    p.add_argument("--verify", action="store_true",
                   help="compare both models' logits and losses on the same tokens")
    p.add_argument("--verify-text", default=None, help="a text file for --verify")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="--verify: largest allowed |logit difference| (fp32)")
    a = p.parse_args(argv)
    need = {"hf": ("--load", "--output"), "megatron": ("--hf-model", "--save")}[a.to]
    for flag in need:
        if not getattr(a, flag[2:].replace("-", "_")):
            p.error(f"--to {a.to} needs {flag}")
    if a.verify_text and not os.path.isfile(a.verify_text):
        p.error(f"--verify-text {a.verify_text}: no such file")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1))))
    from megatron.training import hf_checkpoint as hc

    t0 = time.perf_counter()
    try:
        if a.to == "hf":
            info = hc.megatron_to_hf_dir(a.load, a.output, a.iteration, a.tokenizer_type,
                                         a.tokenizer_model, a.trust_shared_checkpoint_dir)
            print(f"[convert] {info['source']} -> {a.output}: {info['params']:,} parameters, "
                  f"{info['dtype']}, vocabulary {info['vocab']}, tokenizer {info['tokenizer']} "
                  f"[{time.perf_counter() - t0:.1f} s]", flush=True)
            hf_dir, model = a.output, info["model"]
        else:
            info = hc.hf_dir_to_megatron(a.hf_model, a.save, a.make_vocab_size_divisible_by *
                                        a.target_tensor_parallel_size)
            print(f"[convert] {a.hf_model} -> {info['path']}: {info['params']:,} parameters, "
                  f"{info['dtype']}, vocabulary {info['vocab']} padded to {info['padded']}; "
                  f"train from it with --load {a.save} --finetune "
                  f"[{time.perf_counter() - t0:.1f} s]", flush=True)
            hf_dir, model = a.hf_model, info["model"]
        if a.verify:
            diff, loss_m, loss_h, n = hc.verify(model, hf_dir, info["shape"], info["padded"],
                                               a.verify_text)
    except hc.ConversionError as exc:
        print(f"convert_checkpoint: {exc}", file=sys.stderr)
        return 2
    if not a.verify:
        return 0
    ok = diff <= a.tolerance
    # the trainer's loss is over its padded vocabulary: an imported model's zero rows
    # (logit 0) add to its softmax, so the two losses agree only for a trained model
    print(f"[convert] verify: {n} tokens, max |logit difference| {diff:.3g} "
          f"({'within' if ok else 'OVER'} {a.tolerance:g}); loss trainer {loss_m:.6f} "
          f"(vocabulary {info['padded']}), transformers {loss_h:.6f} (vocabulary "
          f"{info['vocab']})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
