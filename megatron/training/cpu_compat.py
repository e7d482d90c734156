"""Run megatron-core 0.16.1 on a machine without CUDA (gloo, CPU tensors).

megatron-core assumes a CUDA device in seven ways (docs/foundation.md lists
the file:line sites). Each assumption gets one *bridge* here. They are applied by
:func:`apply` only when ``torch.cuda.is_available()`` is False, and each is as narrow as
we could make it:

``rng_tracker``
    ``tensor_parallel.random.CudaRNGStatesTracker`` swaps CUDA generator states. We put a
    subclass in its place whose ``add``/``fork`` swap the CPU generator instead, so the
    tensor-parallel dropout and init streams stay separate and reproducible.
``current_device``
    ``torch.cuda.current_device()`` used as an allocation device returns ``"cpu"``.
``synchronize``
    ``torch.cuda.synchronize()`` is a no-op (CPU ops are synchronous).
``cuda_literals``
    factory calls with ``device="cuda"`` allocate on the CPU.
``tensor_cuda``
    ``Tensor.cuda()`` called from megatron-core returns the tensor itself.
``tensor_type``
    ``Tensor.type()`` called from megatron-core reports ``torch.cuda.<T>Tensor`` for a CPU
    tensor, so the dtype checks in the optimizers pass.
``streams``
    ``torch.cuda.Stream``/``stream``/``default_stream`` are a stream that waits for
    nothing and a null context (CPU ops run in program order): megatron-core's partial
    distributed optimizer (hpZ, docs/zeropp.md) makes one at DDP init.

The first four and ``streams`` do not touch ``torch`` at all: the listed megatron-core modules get a
module-global ``torch`` proxy that differs from the real module only in those calls.
The last two patch two ``torch.Tensor`` methods, but only change behaviour for callers
whose module is in ``megatron.core`` (everyone else still gets torch's answer, which on a
CPU-only build is an error for ``.cuda()``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types

import torch

logger = logging.getLogger(__name__)

BRIDGES = (
    "rng_tracker",
    "current_device",
    "synchronize",
    "cuda_literals",
    "tensor_cuda",
    "tensor_type",
    "streams",
)

# megatron-core modules whose code touches torch.cuda.* or allocates on "cuda" on the
# dense-GPT training and checkpointing paths we use. Found with grep and by running.
PROXIED_MODULES = (
    "megatron.core.utils",
    "megatron.core.timers",
    "megatron.core.parallel_state",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "empty_like", "zeros_like",
              "ones_like", "full_like")

_applied: tuple[str, ...] = ()


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _HostStream:
    """A CUDA stream on a machine without one: CPU ops run in program order, so waiting
    for or recording on it is nothing (megatron-core's partial distributed optimizer
    makes one for its inter-instance all-reduce)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass


class _CudaProxy(types.SimpleNamespace):
    """``torch.cuda`` as seen by a proxied module."""

    def __init__(self, bridges):
        super().__init__()
        if "current_device" in bridges:
            self.current_device = lambda: "cpu"
        if "synchronize" in bridges:
            self.synchronize = lambda *a, **k: None
        if "streams" in bridges:
            self.Stream = _HostStream
            self.stream = lambda s=None: contextlib.nullcontext()
            self.default_stream = self.current_stream = lambda *a, **k: _HostStream()

    def __getattr__(self, name):  # only called for names not overridden above
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """``torch`` as seen by a proxied module: the real module plus the bridges."""

    def __init__(self, bridges):
        super().__init__("torch")
        self.cuda = _CudaProxy(bridges)
        if "cuda_literals" in bridges:
            for name in _FACTORIES:
                setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__wrapped__ = fn
    return factory


def _called_from_megatron_core(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("megatron.core")


def _install_tensor_methods(bridges):
    if "tensor_cuda" in bridges:
        real_cuda = torch.Tensor.cuda

        def cuda(self, *args, **kwargs):
            if _called_from_megatron_core():
                return self
            return real_cuda(self, *args, **kwargs)

        cuda.__wrapped__ = real_cuda
        torch.Tensor.cuda = cuda
    if "tensor_type" in bridges:
        real_type = torch.Tensor.type

        def type_(self, *args, **kwargs):
            name = real_type(self, *args, **kwargs)
            if not args and not kwargs and self.device.type == "cpu" \
                    and _called_from_megatron_core():
                return name.replace("torch.", "torch.cuda.", 1)
            return name

        type_.__wrapped__ = real_type
        torch.Tensor.type = type_


def _install_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_reft_cpu", False):
        return

    class CpuRNGStatesTracker(base):
        """megatron-core's RNG tracker forking the CPU default generator."""

        _reft_cpu = True

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # a tracker created before apply() would still be the CUDA one
    mrandom.initialize_rng_tracker(force_reset=True)


def apply(bridges=BRIDGES, force: bool = False) -> tuple[str, ...]:
    """Install the bridges (all by default) when there is no CUDA device.

    Idempotent. Returns the bridges in force. ``force`` applies them even with CUDA
    present (tests only).
    """
    global _applied
    if torch.cuda.is_available() and not force:
        return ()
    unknown = set(bridges) - set(BRIDGES)
    if unknown:
        raise ValueError(f"unknown cpu_compat bridges: {sorted(unknown)}")
    todo = tuple(b for b in bridges if b not in _applied)
    if not todo:
        return _applied
    proxy = _TorchProxy(set(bridges))
    if {"current_device", "synchronize", "cuda_literals", "streams"} & set(todo):
        for modname in PROXIED_MODULES:
            mod = importlib.import_module(modname)
            if getattr(mod, "torch", None) is not None:
                mod.torch = proxy
    _install_tensor_methods(set(todo))
    if "rng_tracker" in todo:
        _install_rng_tracker()
    _applied = tuple(b for b in BRIDGES if b in set(_applied) | set(todo))
    logger.info("megatron-core CPU bridges applied: %s", ", ".join(_applied))
    return _applied


def applied() -> tuple[str, ...]:
    return _applied
