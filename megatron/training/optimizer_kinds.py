"""The optimizers REFT can capture the state of, in one table (:data:`KNOWN_KINDS`): per
kind, the per-param state tensors it keeps, where its step count lives, how to make its
state before step 1 exactly as step 1 would, the settings that cannot be captured (refused
by name, :class:`UnsupportedOptimizer`), and what AOR's holder replays it with; and the
torch optimizers inside a megatron (chained) optimizer.

Apart from the capture (``optimizer_state.py``) and the checkpoint fixes
(``optimizer_checkpoint_fixes.py``), which both read it: the table is what a new optimizer
kind adds to, and start-up's argument checks (``arguments.py``: :data:`BUILT_BY`,
:func:`kind_named`) need it without the rest. Plain torch, no megatron import.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch


def torch_optimizers(optimizer) -> list:
    """The torch.optim optimizers inside a megatron (chained) optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(opt, "optimizer", None) is not None]


def main_params_and_states(optimizer):
    """(main param, its optimizer state dict) in a fixed order over all param groups."""
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield p, opt.state.get(p, {})



# ---- the optimizers whose state REFT can capture -------------------------------------
class UnsupportedOptimizer(RuntimeError):
    """An optimizer (or a setting of one) whose state REFT cannot capture: refused
    before the first step, never silently half-saved."""


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer REFT knows: the per-param state tensors it keeps, where its step
    count lives ("param": ``state["step"]``, "group": ``group["step"]``, None: nowhere),
    how to create its state before step 1 exactly as step 1 would, and which of its
    settings cannot be captured (a reason, or None)."""
    name: str
    matches: Callable[[Any], bool]
    tensor_keys: Callable[[dict], tuple]
    step_in: str | None
    ensure: Callable[[Any, dict, torch.Tensor], None]
    refuse: Callable[[Any, dict], str | None]
    # what AOR's holder replays it with (reft_ext/protect/aor/replica.py), None: AOR
    # cannot protect it
    aor: str | None = None


def _adam_keys(group: dict) -> tuple:
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def _ensure_torch_adam(opt, group: dict, p: torch.Tensor) -> None:
    # what Adam._init_group creates on the first step: zero moments and a step tensor
    # (on the device for capturable/fused, where torch keeps it)
    st = opt.state[p]
    if "step" not in st:
        st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device)
                      if group.get("capturable") or group.get("fused")
                      else torch.tensor(0.0, dtype=torch.float32))
    for key in _adam_keys(group):
        if key not in st:
            st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sgd_keys(group: dict) -> tuple:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _ensure_torch_sgd(opt, group: dict, p: torch.Tensor) -> None:
    # torch's first step sets buf = clone(grad); later ones buf = buf*m + grad (dampening
    # 0). A buffer of -0.0 makes the later formula give grad bit for bit on step 1,
    # signed zeros included (-0.0*m + g == g; a +0.0 buffer would turn g = -0.0 into +0.0)
    if group["momentum"] != 0 and "momentum_buffer" not in opt.state[p]:
        opt.state[p]["momentum_buffer"] = torch.full_like(
            p, -0.0, memory_format=torch.preserve_format)


def _refuse_torch_sgd(opt, group: dict) -> str | None:
    if group["momentum"] != 0 and group.get("dampening", 0) != 0:
        return (f"dampening {group['dampening']} (step 1 skips it, so no momentum buffer "
                "created before step 1 gives the same update)")
    return None


def capturable(opt, group: dict) -> bool:
    """Does this optimizer keep its step (and lr) on the device? torch keeps the flag in
    each param group; apex's and TE's fused optimizers on the optimizer itself
    (``self.capturable``; their defaults hold lr, betas, eps, weight_decay only)."""
    return bool(group.get("capturable", getattr(opt, "capturable", False)))


def _is_fused(opt, name: str) -> bool:
    cls = type(opt)
    return cls.__name__ == name and cls.__module__.split(".")[0] in (
        "apex", "transformer_engine")


def _is_fused_adam(opt) -> bool:
    return _is_fused(opt, "FusedAdam")




def _ensure_fused_adam(opt, group: dict, p: torch.Tensor) -> None:
    # apex's and TE's step() create both moments when a param's state is empty; TE
    # through its own initialize_state (moment dtypes, scales), used as is
    st = opt.state[p]
    if len(st) != 0:
        return
    init = getattr(opt, "initialize_state", None)
    if init is not None:
        if "store_param_remainders" in inspect.signature(init).parameters:
            init(p, store_param_remainders=False)
        else:
            init(p)
        return
    st["exp_avg"] = torch.zeros_like(p)
    st["exp_avg_sq"] = torch.zeros_like(p)


def _refuse_fused_adam(opt, group: dict) -> str | None:
    if getattr(opt, "master_weights", False) or getattr(opt, "store_param_remainders", False):
        return "master weights kept inside the optimizer (master_param state)"
    for attr in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(opt, attr, torch.float32) != torch.float32:
            return f"{attr}={getattr(opt, attr)} (scaled moments kept outside the state)"
    if capturable(opt, group):
        return "capturable=True (its step lives on the device)"
    if not group.get("bias_correction", True):
        return "bias_correction=False (AOR's replay and torch's Adam always correct)"
    return None


KNOWN_KINDS = (
    OptimizerKind("torch.optim.Adam/AdamW",
                  lambda o: isinstance(o, (torch.optim.Adam, torch.optim.AdamW)),
                  _adam_keys, "param", _ensure_torch_adam, lambda o, g: None, aor="adam"),
    OptimizerKind("torch.optim.SGD", lambda o: isinstance(o, torch.optim.SGD),
                  _sgd_keys, None, _ensure_torch_sgd, _refuse_torch_sgd),
    OptimizerKind("apex/TransformerEngine FusedAdam", _is_fused_adam,
                  lambda g: ("exp_avg", "exp_avg_sq"), "group", _ensure_fused_adam,
                  _refuse_fused_adam, aor="fused_adam"),
    # torch SGD's state (momentum_buffer), made the same way before step 1: FusedSGD
    # makes it on its first step (first_run: buf = grad); one made before takes its
    # later formula (buf*m + grad), which the -0.0 buffer turns into the same update,
    # without dampening only (refused as for torch's SGD)
    OptimizerKind("apex/TransformerEngine FusedSGD", lambda o: _is_fused(o, "FusedSGD"),
                  _sgd_keys, None, _ensure_torch_sgd, _refuse_torch_sgd),
)

# what megatron-core 0.16.1 builds for --optimizer adam|sgd, by who supplies the
# optimizers (megatron.core.optimizer: TE first, then apex, else torch's AdamW/SGD):
# the kind of each, so start-up can judge it from the device facts alone
BUILT_BY = {("transformer_engine", "adam"): "apex/TransformerEngine FusedAdam",
            ("apex", "adam"): "apex/TransformerEngine FusedAdam",
            ("torch", "adam"): "torch.optim.Adam/AdamW",
            ("transformer_engine", "sgd"): "apex/TransformerEngine FusedSGD",
            ("apex", "sgd"): "apex/TransformerEngine FusedSGD",
            ("torch", "sgd"): "torch.optim.SGD"}


def kind_named(name: str) -> OptimizerKind:
    return next(k for k in KNOWN_KINDS if k.name == name)


def _class_name(opt) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def kind_of(opt) -> OptimizerKind:
    """The table's entry for a torch optimizer; UnsupportedOptimizer (by name) if none,
    or if a setting of it cannot be captured."""
    for kind in KNOWN_KINDS:
        if kind.matches(opt):
            for group in opt.param_groups:
                why = kind.refuse(opt, group)
                if why:
                    raise UnsupportedOptimizer(
                        f"REFT cannot capture the state of {_class_name(opt)} with {why}")
            return kind
    raise UnsupportedOptimizer(
        f"REFT cannot capture the state of {_class_name(opt)}; supported: "
        + ", ".join(k.name for k in KNOWN_KINDS))

