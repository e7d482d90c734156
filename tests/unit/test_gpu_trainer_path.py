"""The trainer's GPU path, checked where it can be without a GPU: the layer spec for
--transformer-impl (megatron-core 0.16.1's real TE spec signature), the flag's
resolution and refusals, micro-batches moved to the model's device, the backend choice.
The CUDA halves run only where CUDA (and TransformerEngine) are present."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron.training import llama_model
from megatron.training.arguments import (ArgumentError, build_parser, resolve_transformer_impl,
                                         validate_args)
from megatron.training.initialize import distributed_backend
from megatron.training.training_loop import batch_device, batch_to_device

CUDA = torch.cuda.is_available()
TE = CUDA and llama_model.transformer_engine_missing() is None
needs_no_cuda = pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_te = pytest.mark.skipif(not TE, reason="needs TransformerEngine and a CUDA device")


def _args(*argv):
    args = build_parser().parse_args(["--mock-data", *argv])
    args.world_size = 1
    return validate_args(args)


# ---- layer spec ---------------------------------------------------------------------
def test_te_spec_call_binds_to_the_installed_signature():
    from megatron.core.models.gpt.gpt_layer_specs import \
        get_gpt_layer_with_transformer_engine_spec as te_spec

    sig = inspect.signature(te_spec)
    sig.bind(**llama_model.TE_SPEC_KWARGS)  # the call layer_spec makes
    with pytest.raises(TypeError):  # the old call: RMSNorm comes from the config instead
        sig.bind(normalization="RMSNorm")


def test_local_spec_is_the_cpu_spec_and_rmsnorm_is_in_the_config():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert llama_model.layer_spec("local") == get_gpt_layer_local_spec(normalization="RMSNorm")
    args = _args("--transformer-impl", "local")
    assert llama_model.transformer_config(args).normalization == "RMSNorm"


def test_layer_spec_refuses_an_unknown_impl():
    with pytest.raises(ValueError, match="--transformer-impl"):
        llama_model.layer_spec("fused")


@needs_no_cuda
def test_layer_spec_refuses_te_without_cuda():
    assert llama_model.transformer_engine_missing() == "no CUDA device here"
    with pytest.raises(RuntimeError, match=r"--transformer-impl.*pip install \.\[gpu\]"):
        llama_model.layer_spec("transformer_engine")


# ---- --transformer-impl -----------------------------------------------------------------
@pytest.mark.parametrize("requested,missing,want", [
    (None, None, "transformer_engine"),
    (None, "no CUDA device here", "local"),
    ("local", None, "local"),
    ("local", "TransformerEngine is not installed", "local"),
    ("transformer_engine", None, "transformer_engine"),
])
def test_transformer_impl_resolution(requested, missing, want):
    assert resolve_transformer_impl(requested, missing) == want


def test_transformer_engine_without_it_is_an_argument_error():
    with pytest.raises(ArgumentError) as err:
        resolve_transformer_impl("transformer_engine", "TransformerEngine is not installed")
    msg = str(err.value)
    assert msg.startswith("--transformer-impl:") and "pip install .[gpu]" in msg
    assert "TransformerEngine is not installed" in msg and "--transformer-impl local" in msg


@needs_no_cuda
def test_flag_on_this_machine_defaults_to_local_and_refuses_te():
    args = _args()
    assert args.transformer_impl == "local"
    assert getattr(args, "create_attention_mask_in_dataloader", True)  # CPU needs the mask
    with pytest.raises(ArgumentError, match=r"--transformer-impl: .*no CUDA device here"):
        _args("--transformer-impl", "transformer_engine")


@needs_te
def test_flag_with_te_defaults_to_it_and_drops_the_loader_mask():
    args = _args()
    assert args.transformer_impl == "transformer_engine"
    assert args.create_attention_mask_in_dataloader is False
    with pytest.raises(ArgumentError, match="--reset-attention-mask"):
        _args("--reset-attention-mask")
    assert _args("--transformer-impl", "local", "--reset-attention-mask").transformer_impl \
        == "local"


# ---- micro-batches on the device ------------------------------------------------------
def _batch():
    return {"tokens": torch.arange(8).view(2, 4), "labels": torch.arange(1, 9).view(2, 4),
            "loss_mask": torch.ones(2, 4), "position_ids": torch.arange(4).repeat(2, 1),
            "attention_mask": None, "note": "not a tensor"}


def test_batch_to_device_none_is_the_batch_itself():
    batch = _batch()
    assert batch_to_device(batch, None) is batch


def test_batch_to_device_same_device_keeps_the_tensor_objects():
    batch = _batch()
    out = batch_to_device(batch, torch.device("cpu"))
    assert out.keys() == batch.keys()
    assert all(out[k] is batch[k] for k in batch)


def test_batch_to_device_moves_tensors_only():
    batch = _batch()
    del batch["labels"]  # a first pipeline stage's view: missing keys stay missing
    out = batch_to_device(batch, torch.device("meta"))  # a real move without a GPU
    assert out.keys() == batch.keys() and "labels" not in out
    for k in ("tokens", "loss_mask", "position_ids"):
        assert out[k].device.type == "meta"
        assert (out[k].dtype, out[k].shape) == (batch[k].dtype, batch[k].shape)
        assert batch[k].device.type == "cpu"  # the loader's batch is untouched
    assert out["attention_mask"] is None and out["note"] == "not a tensor"


@needs_no_cuda
def test_batch_device_is_none_without_cuda():
    assert batch_device() is None


@needs_cuda
def test_batch_to_device_copies_pinned_and_pageable_to_the_current_device():
    batch = _batch()
    batch["tokens"] = batch["tokens"].pin_memory()
    out = batch_to_device(batch, batch_device())
    torch.cuda.synchronize()
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        assert out[k].device == torch.device("cuda", torch.cuda.current_device())
        assert torch.equal(out[k].cpu(), batch[k])


# ---- process group backend ------------------------------------------------------------
def test_backend_is_nccl_on_cuda_and_gloo_on_cpu():
    assert distributed_backend(None, cuda=True) == "nccl"
    assert distributed_backend(None, cuda=False) == "gloo"
    assert distributed_backend("gloo", cuda=True) == "gloo"
    with pytest.raises(RuntimeError, match="--distributed-backend nccl"):
        distributed_backend("nccl", cuda=False)
