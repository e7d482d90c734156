"""The Hugging Face Llama mapping (megatron/training/hf_llama.py) and the byte-level
tokenizer export (megatron/training/hf_tokenizer.py), without a process group. The
logits of converted models are compared in tests/integration/test_hf_convert.py."""

from __future__ import annotations

import pytest
import torch

from megatron.training.hf_llama import ConversionError, hf_to_megatron, megatron_to_hf, \
    shape_from_hf

SHAPES = {"gqa": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "num_query_groups": 2, "ffn_hidden_size": 48},
          "mha": {"num_layers": 1, "hidden_size": 24, "num_attention_heads": 3,
                  "num_query_groups": 3, "ffn_hidden_size": 40}}


def _hf_state(shape: dict, vocab: int, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(0)
    h, f = shape["hidden_size"], shape["ffn_hidden_size"]
    kv = shape["num_query_groups"] * h // shape["num_attention_heads"]

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)
    sd = {"model.embed_tokens.weight": r(vocab, h), "lm_head.weight": r(vocab, h),
          "model.norm.weight": r(h)}
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
                   p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(kv, h),
                   p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, h),
                   p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
                   p + "mlp.down_proj.weight": r(h, f)})
    return sd


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_round_trip_is_bit_identical_and_pads_the_vocabulary(name):
    shape = SHAPES[name]
    hsd = _hf_state(shape, vocab=100)
    msd = hf_to_megatron(hsd, shape, padded_vocab=128)
    assert msd["embedding.word_embeddings.weight"].shape[0] == 128
    assert not msd["output_layer.weight"][100:].any()  # padding rows are zeros
    back = megatron_to_hf(msd, shape, vocab_size=100)
    assert set(back) == set(hsd)
    for k, v in hsd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_qkv_is_fused_per_query_group_as_megatron_core_lays_it_out():
    """Rows of megatron-core's linear_qkv: for each group, its query heads, then k, then v."""
    shape = SHAPES["gqa"]  # 4 heads, 2 groups, head_dim 8
    hsd = _hf_state(shape, vocab=8, dtype=torch.float32)
    q, k, v = (hsd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    fused = hf_to_megatron(hsd, shape, 8)["decoder.layers.0.self_attention.linear_qkv.weight"]
    hd = 8
    group1 = fused[4 * hd:8 * hd]  # group 1: q heads 2 and 3, then k1, then v1
    assert torch.equal(group1[:2 * hd], q[2 * hd:4 * hd])
    assert torch.equal(group1[2 * hd:3 * hd], k[hd:2 * hd])
    assert torch.equal(group1[3 * hd:], v[hd:2 * hd])
    fc1 = hf_to_megatron(hsd, shape, 8)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], hsd["model.layers.0.mlp.gate_proj.weight"])  # [gate; up]


def test_unmapped_weights_are_refused_not_dropped():
    shape = SHAPES["mha"]
    hsd = _hf_state(shape, vocab=16)
    hsd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(24)
    with pytest.raises(ConversionError, match="q_proj.bias"):
        hf_to_megatron(hsd, shape, 16)
    msd = hf_to_megatron(_hf_state(shape, vocab=16), shape, 16)
    msd["decoder.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(ConversionError, match="extra.weight"):
        megatron_to_hf(msd, shape)


BASE = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 48,
        "vocab_size": 100}


@pytest.mark.parametrize("change,match", [
    ({"model_type": "mistral"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"),
    ({"head_dim": 16}, "head_dim"),
])
def test_configs_the_trainer_cannot_express_are_refused_by_name(change, match):
    with pytest.raises(ConversionError, match=match):
        shape_from_hf({**BASE, **change})


def test_rope_theta_from_both_config_spellings():
    assert shape_from_hf({**BASE, "rope_theta": 5e5})["rotary_base"] == 5e5
    assert shape_from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 1e6}})["rotary_base"] == 1e6
    assert shape_from_hf(BASE)["num_query_groups"] == 2


def test_byte_level_tokenizer_export_gives_the_trainers_ids():
    pytest.importorskip("transformers")
    from megatron.training.hf_tokenizer import EOD, PAD, byte_level_tokenizer
    from megatron.training.tokenizer import ByteLevelTokenizer

    hf, mine = byte_level_tokenizer(), ByteLevelTokenizer()
    for text in ["plain ascii", "  leading spaces\n\ttabs ", "héllo wörld ✓ 日本語", "\x00\x7f\xff"]:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == mine.tokenize(text)
        assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id) == (EOD, PAD) == (mine.eod, mine.pad)
