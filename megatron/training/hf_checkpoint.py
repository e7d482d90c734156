"""torch_dist checkpoint <-> Hugging Face Llama directory, in one process (tools/convert_checkpoint.py).

The model is built by the trainer's own code at TP 1, PP 1 in a one-rank gloo group on
loopback, so megatron-core's dist_checkpointing does the resharding from whatever TP/PP/VPP
a checkpoint was saved with (and into whatever the trainer later loads it at); the tensor
mapping itself is megatron/training/hf_llama.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil

import torch

from megatron.training.hf_llama import ConversionError, hf_config, hf_to_megatron, \
    megatron_to_hf, shape_from_hf

__all__ = ["ConversionError", "megatron_to_hf_dir", "hf_dir_to_megatron", "verify"]

SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "max_position_embeddings", "norm_epsilon", "rotary_base")
CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "data", "pd_english.jsonl.gz")


def _model(shape: dict, padded_vocab: int, bf16: bool):
    """The trainer's GPTModel (local spec) at TP 1, PP 1, in a one-rank process group."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.llama_model import build_model, transformer_config

    if float(shape["rotary_base"]) != int(shape["rotary_base"]):
        raise ConversionError(f"rope_theta {shape['rotary_base']} is not an integer "
                              f"(the trainer's --rotary-base is)")
    argv = ["--num-layers", shape["num_layers"], "--hidden-size", shape["hidden_size"],
            "--num-attention-heads", shape["num_attention_heads"],
            "--num-query-groups", shape["num_query_groups"],
            "--ffn-hidden-size", shape["ffn_hidden_size"],
            "--seq-length", min(int(shape["max_position_embeddings"]), 4096),
            "--max-position-embeddings", shape["max_position_embeddings"],
            "--rotary-base", int(shape["rotary_base"]), "--norm-epsilon", shape["norm_epsilon"],
            "--transformer-impl", "local", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", padded_vocab, "--micro-batch-size", 1, "--global-batch-size", 1,
            "--train-iters", 1] + (["--bf16"] if bf16 else [])
    args = parse_args([str(a) for a in argv], world_size=1)
    args.padded_vocab_size = padded_vocab
    if not torch.distributed.is_initialized():
        initialize_megatron(args)
    return args, build_model(args, transformer_config(args))[0].module


def _problems(path: str) -> list[str]:
    """What fails in ``path``'s checksums (checkpoint_integrity.py, no process group)."""
    from megatron.training.checkpoint_integrity import IntegrityError, index_of, verify_files

    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return [f"{path} is missing or incomplete (no metadata.json)"]
    try:
        return verify_files(path, index_of(path))
    except IntegrityError as exc:
        return [str(exc)]


def _checkpoint_path(root: str, iteration: int | None) -> tuple[str, int]:
    """The checkpoint to convert: ``--iteration``'s, else the tracker's newest whose files
    all match their checksums, else the newest older one that does (said in a line), as
    the trainer's --load chooses. A corrupted checkpoint is never converted."""
    from megatron.training.checkpointing import CheckpointError, checkpoint_dir, read_tracker

    if not os.path.isdir(root):
        raise ConversionError(f"--load {root}: no such directory (give the trainer's --save)")
    try:
        newest = read_tracker(root) if iteration is None else iteration
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    if newest is None:
        raise ConversionError(f"--load {root}: no latest_checkpointed_iteration.txt (not a "
                              f"checkpoint root; give --iteration N for an iter_ directory's)")
    older = [] if iteration is not None else sorted(
        (int(n[5:]) for n in os.listdir(root) if re.fullmatch(r"iter_\d+", n)
         and int(n[5:]) < newest), reverse=True)
    refused = []
    for it in [newest] + older:
        path = checkpoint_dir(root, it)
        problems = _problems(path)
        if not problems:
            if refused:
                print(f"[convert] converting {path} instead: the newest older checkpoint "
                      f"in {root} whose files all match their checksums", flush=True)
            return path, it
        refused.append(path)
        print(f"[convert] checkpoint {path} refused: {'; '.join(problems[:3])}", flush=True)
    others = sorted(int(n[5:]) for n in os.listdir(root) if re.fullmatch(r"iter_\d+", n)
                    and int(n[5:]) != newest)
    hint = (f"; --iteration {' or '.join(map(str, others[-3:]))} converts another"
            if iteration is not None and others else
            "; restore its files from a copy (nothing older verifies)")
    raise ConversionError(f"--load {root}: no checkpoint to convert (refused: "
                          f"{', '.join(refused)}){hint}")


def _shape_from_common(common: dict) -> tuple[dict, dict]:
    saved = dict(common.get("identity", {}).get("fields", {}))
    saved.update(common.get("args", {}))  # newer checkpoints record every model field
    saved.setdefault("max_position_embeddings", saved.get("seq_length"))
    saved.setdefault("norm_epsilon", 1e-5)
    saved.setdefault("rotary_base", 10000)
    missing = [k for k in SHAPE_KEYS if saved.get(k) is None]
    if missing:
        raise ConversionError(f"the checkpoint does not record {', '.join(missing)}")
    return {k: saved[k] for k in SHAPE_KEYS}, saved


def megatron_to_hf_dir(root: str, out: str, iteration: int | None = None,
                       tokenizer_type: str | None = None,
                       tokenizer_model: str | None = None,
                       trust_shared_dir: bool = False) -> dict:
    """``trust_shared_dir``: --trust-shared-checkpoint-dir (a checkpoint's metadata is a
    pickle: one another user can write is refused, as the trainer's --load refuses it)."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from megatron.training.path_checks import foreign_checkpoint_error

    _writable_dir("--output", out)  # before any work
    why = foreign_checkpoint_error("--load", root, trust=trust_shared_dir)
    if why:
        raise ConversionError(why)
    path, it = _checkpoint_path(root, iteration)  # verified: never a torn or corrupted one
    why = foreign_checkpoint_error("--load", path, trust=trust_shared_dir)
    if why:  # an iter_ directory of this user's root that others can write
        raise ConversionError(why)
    common = dist_checkpointing.load_common_state_dict(path)
    shape, saved = _shape_from_common(common)
    bf16 = bool(saved.get("bf16"))
    args, model = _model(shape, int(saved["padded_vocab_size"]), bf16)
    with torch.no_grad():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"], strict=True)
    vocab = saved.get("hf_vocab_size") or int(saved["padded_vocab_size"])
    hsd = megatron_to_hf(model.state_dict(), shape, vocab)
    dtype = torch.bfloat16 if bf16 else torch.float32
    # megatron-core's torch-norm fallback keeps the RMSNorm weights in fp32 under bf16:
    # written in the model's dtype where that is exact, else kept fp32 (never rounded)
    hsd = {k: (v.to(dtype) if v.dtype != dtype and torch.equal(v.to(dtype).to(v.dtype), v)
               else v) for k, v in hsd.items()}
    _writable_dir("--output", out)
    os.makedirs(out, exist_ok=True)
    from megatron.training import hf_tokenizer

    kind, tok_model = tokenizer_type or saved.get("tokenizer_type"), saved.get("tokenizer_model")
    if kind is None and saved.get("imported_from"):
        # an import records no trainer tokenizer: the model's own, copied beside it
        # (hf_dir_to_megatron), or none at all (never the byte-level default's ids)
        tok_model = os.path.join(root, "tokenizer")
        kind = "HuggingFaceTokenizer" if os.path.isdir(tok_model) else "NullTokenizer"
    kind = kind or "ByteLevelTokenizer"
    tokens = hf_tokenizer.export(kind, tokenizer_model or tok_model, out)
    save_file(hsd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(shape, vocab, dtype, tokens), f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in tokens.items() if v is not None}, f, indent=2)
    return {"source": path, "params": sum(t.numel() for t in hsd.values()),
            "dtype": str(dtype), "vocab": vocab, "tokenizer": kind, "model": model,
            "shape": shape, "iteration": it, "padded": int(saved["padded_vocab_size"])}


def _writable_dir(flag: str, path: str) -> None:
    """Refuses, before any work, a path that is a file or a non-empty directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConversionError(f"{flag} {path} is a file; give a new or empty directory")
    if flag == "--output" and os.path.isdir(path) and os.listdir(path):
        raise ConversionError(f"{flag} {path} exists and is not empty; give a new directory")


def _json(path: str, flag: str, hf_dir: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{flag} {hf_dir}: {os.path.basename(path)} cannot be read "
                              f"({exc}); save the model again with save_pretrained") from None
    if not isinstance(doc, dict):
        raise ConversionError(f"{flag} {hf_dir}: {os.path.basename(path)} is not a JSON object")
    return doc


def _read_hf(hf_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"--hf-model {hf_dir}: no config.json")
    cfg = _json(cfg_path, "--hf-model", hf_dir)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _json(index, "--hf-model", hf_dir).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"--hf-model {hf_dir}: model.safetensors.index.json has "
                                  f"no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"--hf-model {hf_dir}: no model.safetensors (or its index); "
                              f"save the model with safe_serialization=True")
    sd = {}
    for name in files:
        try:
            sd.update(load_file(os.path.join(hf_dir, name)))
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: one line
            raise ConversionError(f"--hf-model {hf_dir}: {name} cannot be read "
                                  f"({type(exc).__name__}: {str(exc)[:200]}); truncated or "
                                  f"not safetensors: copy or save it again") from None
    return cfg, sd


def hf_dir_to_megatron(hf_dir: str, root: str, divisible_by: int = 128) -> dict:
    from megatron.core import dist_checkpointing

    from megatron.training.checkpoint_integrity import seal_checkpoint
    from megatron.training.checkpointing import CHECKPOINT_VERSION, _private_dirs, \
        _write_tracker, checkpoint_dir, read_tracker, run_identity
    from reft_ext.state.identity import stamp

    _writable_dir("--save", root)  # before any work
    if os.path.isdir(root) and read_tracker(root) is not None:
        raise ConversionError(f"--save {root} already holds a checkpoint; choose a new "
                              f"directory (nothing is overwritten)")
    cfg, hsd = _read_hf(hf_dir)
    shape = shape_from_hf(cfg)
    vocab = int(cfg["vocab_size"])
    padded = -(-vocab // divisible_by) * divisible_by
    dtypes = {t.dtype for t in hsd.values()}
    bf16 = dtypes == {torch.bfloat16}  # fp16/fp32/mixed: the trainer's fp32 (lossless)
    args, model = _model(shape, padded, bf16)
    msd = hf_to_megatron(hsd, shape, padded)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(msd, strict=False)
    if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
        raise ConversionError(f"weights do not match the model: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}")
    path = checkpoint_dir(root, 0)
    _private_dirs(root, path)
    saved_args = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                  "data_parallel_size": 1, "padded_vocab_size": padded, "bf16": bf16,
                  "seq_length": args.seq_length, **shape,
                  "imported_from": "huggingface", "hf_vocab_size": vocab}
    sd = {"checkpoint_version": CHECKPOINT_VERSION, "model": model.sharded_state_dict(),
          "args": saved_args, "identity": stamp(run_identity(args)),
          "train_state": {"iteration": 0, "extra": "{}"}}
    dist_checkpointing.save(sd, path)
    seal_checkpoint(path, 0)
    _write_tracker(root, 0)
    tok_dir = os.path.join(root, "tokenizer")
    copied = [n for n in os.listdir(hf_dir) if n.startswith(("tokenizer", "special_tokens"))
              or n.endswith(".model")]
    if copied:  # the tokenizer the model was trained with travels with it
        os.makedirs(tok_dir, exist_ok=True)
        for n in copied:
            shutil.copy2(os.path.join(hf_dir, n), tok_dir)
    return {"path": path, "params": sum(t.numel() for t in hsd.values()),
            "dtype": str(next(iter(dtypes))), "vocab": vocab, "padded": padded,
            "model": model, "shape": shape}


def _verify_tokens(hf_dir: str, text_file: str | None, vocab: int, n: int) -> torch.Tensor:
    """Token ids to compare on: the directory's tokenizer on the text (a file, or the
    shipped corpus's last documents); seeded random ids only where the directory has no
    tokenizer (a mock-data model). A tokenizer that fails to load, or that encodes the
    text to fewer than 2 ids or to unknown pieces only, is refused: it is broken."""
    if not any(os.path.isfile(os.path.join(hf_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(hf_dir)
    except Exception as exc:  # noqa: BLE001 - any failure: the export is unusable
        raise ConversionError(f"--verify: transformers cannot load the tokenizer in {hf_dir} "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if text_file:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    else:
        with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for line in f]
        text = "\n\n".join(docs[-3:])  # the tail: the validation split's side
    ids = tok(text, add_special_tokens=False)["input_ids"][:n]
    if len(ids) < 2 or (tok.unk_token_id is not None and set(ids) == {tok.unk_token_id}):
        raise ConversionError(f"--verify: the tokenizer in {hf_dir} encodes "
                              f"{len(text)} characters of {text_file or 'the corpus'} to "
                              f"{ids[:8]}: it is broken (transformers "
                              f"{tok.__class__.__name__}, {len(tok)} pieces)")
    return torch.tensor([ids])


def verify(model, hf_dir: str, shape: dict, padded_vocab: int, text_file: str | None = None):
    """(max |logit diff| over the shared vocabulary, trainer loss, transformers loss,
    tokens): both models in fp32 on the same tokens."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar: one [convert] line instead

    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, use_safetensors=True,
                                          attn_implementation="eager").eval()
    n = min(int(shape["max_position_embeddings"]), 256)
    tokens = _verify_tokens(hf_dir, text_file, hf.config.vocab_size, n)
    s = tokens.shape[1]
    if any(p.dtype != torch.float32 for p in model.parameters()):
        # a bf16 model (its config casts activations) rebuilt in fp32 with the same weights
        weights = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                   for k, v in model.state_dict().items()}
        _, model = _model(shape, padded_vocab, bf16=False)
        model.load_state_dict(weights, strict=True)
    model.eval()
    with torch.no_grad():
        mask = ~torch.tril(torch.ones(s, s, dtype=torch.bool)).view(1, 1, s, s)
        lm = model(tokens, torch.arange(s).unsqueeze(0), mask).float()
        lh = hf(tokens).logits.float()
    v = min(lm.shape[-1], lh.shape[-1])
    diff = (lm[..., :v] - lh[..., :v]).abs().max().item()
    loss = [F.cross_entropy(lg[0, :-1], tokens[0, 1:]).item() for lg in (lm, lh)]
    return diff, loss[0], loss[1], s
