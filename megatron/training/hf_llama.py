"""The Hugging Face Llama layout of this trainer's model, both ways (tools/convert_checkpoint.py).

Pure tensor mapping, no process group: a megatron-core GPTModel state dict (TP 1, PP 1,
one chunk: dist_checkpointing reshards any saved TP/PP/VPP into it) <-> a
``LlamaForCausalLM`` state dict. What has to be exact:

* Q/K/V: megatron-core fuses them per query group, ``[g0: q (heads/groups) k v | g1: ...]``
  along the output dimension, each ``head_dim`` rows; transformers keeps three matrices.
* gate/up: ``linear_fc1`` is ``[gate; up]`` (megatron's SwiGLU: ``silu(x[0]) * x[1]``).
* RoPE: megatron-core's default (``rotary_interleaved=False``) rotates halves, as
  transformers' ``rotate_half`` does, so no row permutation (Meta's original checkpoints
  need one; these do not). Base from ``--rotary-base`` = ``rope_theta``.
* RMSNorm: same formula, ``--norm-epsilon`` = ``rms_norm_eps``; the local spec keeps the
  norms apart (``input_layernorm``), TransformerEngine's fuses them into the next linear
  (``linear_qkv.layer_norm_weight``): both are read, the local names are written.
* Embeddings untied (``share_embeddings_and_output_weights=False``); the padded vocabulary
  rows (``--make-vocab-size-divisible-by``) are kept or cropped by ``vocab_size``.
"""

from __future__ import annotations

import torch

# HF config fields this trainer's Llama cannot express: refused by name on import
UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
               "pretraining_tp": 1}


class ConversionError(ValueError):
    """A shape, key or config the conversion cannot map; the message names it."""


def hf_config(shape: dict, vocab_size: int, dtype: torch.dtype, tokens: dict) -> dict:
    """config.json for ``LlamaForCausalLM`` from the trainer's model shape."""
    heads = shape["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape["hidden_size"], "intermediate_size": shape["ffn_hidden_size"],
        "num_hidden_layers": shape["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": shape.get("num_query_groups") or heads,
        "head_dim": shape["hidden_size"] // heads,
        "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": shape["norm_epsilon"],
        # both spellings: transformers 5 reads rope_parameters, 4.x rope_theta
        "rope_theta": float(shape["rotary_base"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(shape["rotary_base"])},
        "vocab_size": vocab_size, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "initializer_range": shape.get("init_method_std", 0.02),
        "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", ""),
        "use_cache": True, **tokens,
    }


def shape_from_hf(cfg: dict) -> dict:
    """The trainer's model flags from an HF Llama config.json; refuses what it cannot map."""
    if cfg.get("model_type") != "llama":
        raise ConversionError(f"config.json: model_type {cfg.get('model_type')!r}, only "
                              f"'llama' converts")
    for key, want in UNSUPPORTED.items():
        if key in cfg and cfg[key] != want:
            raise ConversionError(f"config.json: {key}={cfg[key]!r} is not supported "
                                  f"(this trainer's Llama has {key}={want!r})")
    # transformers 5 keeps RoPE in rope_parameters; 4.x in rope_theta/rope_scaling
    rope = dict(cfg.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ConversionError(f"config.json: RoPE scaling {rope or cfg.get('rope_scaling')} "
                              f"is not supported (this trainer's RoPE is the default one)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConversionError(f"config.json: no integer {', '.join(missing)} (not a Llama "
                              f"config.json)")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim", hidden // heads) != hidden // heads:
        raise ConversionError(f"config.json: head_dim {cfg['head_dim']} != hidden_size / "
                              f"num_attention_heads ({hidden // heads})")
    return {"num_layers": cfg["num_hidden_layers"], "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": cfg.get("num_key_value_heads") or heads,
            "ffn_hidden_size": cfg["intermediate_size"],
            "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
            "norm_epsilon": cfg.get("rms_norm_eps", 1e-5),
            "rotary_base": theta,
            "init_method_std": cfg.get("initializer_range", 0.02)}


def _qkv_split(w: torch.Tensor, shape: dict):
    heads, groups = shape["num_attention_heads"], shape["num_query_groups"]
    hd = shape["hidden_size"] // heads
    per = heads // groups
    w = w.reshape(groups, per + 2, hd, -1)
    q = w[:, :per].reshape(heads * hd, -1)
    k = w[:, per].reshape(groups * hd, -1)
    v = w[:, per + 1].reshape(groups * hd, -1)
    return q, k, v


def _qkv_fuse(q, k, v, shape: dict) -> torch.Tensor:
    heads, groups = shape["num_attention_heads"], shape["num_query_groups"]
    hd = shape["hidden_size"] // heads
    per = heads // groups
    h = q.shape[-1]
    return torch.cat([q.reshape(groups, per, hd, h), k.reshape(groups, 1, hd, h),
                      v.reshape(groups, 1, hd, h)], dim=1).reshape(-1, h)


def _take(sd: dict, *names: str) -> torch.Tensor:
    for n in names:
        if n in sd:
            return sd.pop(n)
    raise ConversionError(f"checkpoint has none of {', '.join(names)}")


def megatron_to_hf(msd: dict, shape: dict, vocab_size: int | None = None) -> dict:
    """megatron-core GPTModel state dict (TP 1, PP 1) -> LlamaForCausalLM state dict.
    ``vocab_size``: rows kept of the (padded) embedding and output layer (None: all)."""
    sd = {k: v for k, v in msd.items() if not k.endswith("_extra_state")}
    out = {}
    emb = _take(sd, "embedding.word_embeddings.weight")
    head = _take(sd, "output_layer.weight")
    rows = vocab_size or emb.shape[0]
    out["model.embed_tokens.weight"] = emb[:rows].clone()
    out["lm_head.weight"] = head[:rows].clone()
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight")
    for i in range(shape["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = _take(
            sd, m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight")
        q, k, v = _qkv_split(_take(sd, m + "self_attention.linear_qkv.weight"), shape)
        out[h + "self_attn.q_proj.weight"] = q.clone()
        out[h + "self_attn.k_proj.weight"] = k.clone()
        out[h + "self_attn.v_proj.weight"] = v.clone()
        out[h + "self_attn.o_proj.weight"] = _take(sd, m + "self_attention.linear_proj.weight")
        out[h + "post_attention_layernorm.weight"] = _take(
            sd, m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight")
        gate, up = _take(sd, m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate.clone()
        out[h + "mlp.up_proj.weight"] = up.clone()
        out[h + "mlp.down_proj.weight"] = _take(sd, m + "mlp.linear_fc2.weight")
    if sd:  # a weight nobody mapped would be lost silently
        raise ConversionError(f"checkpoint keys not mapped to Hugging Face Llama: "
                              f"{', '.join(sorted(sd)[:5])}{' ...' if len(sd) > 5 else ''}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(hsd: dict, shape: dict, padded_vocab: int) -> dict:
    """LlamaForCausalLM state dict -> megatron-core GPTModel (local spec) state dict, the
    vocabulary padded with zero rows to ``padded_vocab`` (the trainer's padding)."""
    sd = dict(hsd)
    sd.pop("model.rotary_emb.inv_freq", None)
    for i in range(shape["num_layers"]):
        sd.pop(f"model.layers.{i}.self_attn.rotary_emb.inv_freq", None)
    out = {}
    emb = _take(sd, "model.embed_tokens.weight")
    head = sd.pop("lm_head.weight", None)
    if head is None:  # tied embeddings: this trainer unties them, same function
        head = emb
    for name, w in (("embedding.word_embeddings.weight", emb), ("output_layer.weight", head)):
        if w.shape[0] > padded_vocab:
            raise ConversionError(f"vocabulary of {w.shape[0]} rows > padded {padded_vocab}")
        pad = w.new_zeros(padded_vocab - w.shape[0], w.shape[1])
        out[name] = torch.cat([w, pad]) if pad.numel() else w.clone()
    out["decoder.final_layernorm.weight"] = _take(sd, "model.norm.weight")
    for i in range(shape["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "input_layernorm.weight"] = _take(sd, h + "input_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            _take(sd, h + "self_attn.q_proj.weight"), _take(sd, h + "self_attn.k_proj.weight"),
            _take(sd, h + "self_attn.v_proj.weight"), shape)
        out[m + "self_attention.linear_proj.weight"] = _take(sd, h + "self_attn.o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = _take(sd, h + "post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(sd, h + "mlp.gate_proj.weight"), _take(sd, h + "mlp.up_proj.weight")])
        out[m + "mlp.linear_fc2.weight"] = _take(sd, h + "mlp.down_proj.weight")
    if sd:
        raise ConversionError(f"Hugging Face weights not mapped: "
                              f"{', '.join(sorted(sd)[:5])}{' ...' if len(sd) > 5 else ''}")
    return {k: v.contiguous() for k, v in out.items()}
