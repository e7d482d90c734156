"""Optimizer state inside megatron optimizers: what REFT captures, and the fixes
resume needs with torch Adam.

REFT lists its snapshot layout once, before step 1, so every state tensor an optimizer
would create lazily inside ``step()`` is created first (:func:`ensure_state`), per kind
from one table (:data:`KNOWN_KINDS`); an optimizer not in it is refused by name, and
after the first step :class:`FirstStepCheck` refuses any state the layout missed.

Without apex/TransformerEngine, megatron-core 0.16.1 runs torch's Adam inside its
optimizers, and resuming it has three upstream bugs (docs/foundation.md), SGD a fourth:

1. ``DistributedOptimizer.state_dict()`` reads ``state["step"]`` of every param, so a
   fresh optimizer (no state yet) cannot even build its load state dict.
   -> :func:`ensure_state` creates zero moments and a step per param first.
2. ``load_parameter_state_from_dp_reshardable`` copies into fp32 leaf params without
   ``no_grad``. -> checkpointing.py loads under ``torch.no_grad()``.
3. ``load_state_dict`` assigns ONE shared ``step`` tensor to all params (torch Adam then
   increments it once per param per step) and the step is saved as a non-persistent
   object, so the fresh 0 wins. -> we save the step ourselves (:func:`optimizer_steps`)
   and give every param its own tensor again (:func:`set_optimizer_steps`).
4. SGD has no ``init_state_fn``, which every load calls. -> :func:`fill_missing_init_state_fn`.

With ``--bf16`` (or ``--fp16``) and the non-distributed optimizer, a fifth:

5. ``Float16OptimizerWithFloat16Params.sharded_state_dict`` maps the torch optimizer's
   state ids (numbered over ALL params of its groups) to the model's sharded tensors
   through ``float16_groups`` only: it assumes Megatron-LM's ``Float16Module`` cast every
   param to 16 bits. Our GPTModel is built with ``params_dtype`` instead, and the local
   spec's RMSNorm (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm``, created without a dtype)
   keeps fp32 weights, which the optimizer steps as ``fp32_from_fp32_groups``. Their
   state ids map to nothing, so every bf16 save (and load) failed with "Param id N does
   not match any model sharded param" (and in a group mixing both kinds the ids would
   silently map to the wrong tensors). Its main params, one list per group, are then a
   list holding an empty list (the norms' group has no float16 params), and
   dist_checkpointing's ``extract_matching_values`` drops the position of an empty list
   inside a list: such a checkpoint saves but never loads ("Cannot merge two lists with
   different lengths"). -> :func:`fix_float16_sharded_state_dict`: the ids mapped over
   every param, the main params saved by group index, non-empty groups only.
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


def captured_states(optimizer):
    """(main param, its state dict, the state keys REFT captures as tensors) in a fixed
    order over all torch optimizers and param groups (TrainingState.state_tensors)."""
    for opt in torch_optimizers(optimizer):
        kind = kind_of(opt)
        for group in opt.param_groups:
            keys = kind.tensor_keys(group)
            for p in group["params"]:
                yield p, opt.state.get(p, {}), keys


def ensure_state(optimizer) -> None:
    """Create every state tensor the first step would create, where a param has none,
    so the snapshot layout listed now is final. Unknown optimizers are refused here."""
    for opt in torch_optimizers(optimizer):
        kind = kind_of(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                kind.ensure(opt, group, p)


ensure_adam_state = ensure_state  # the name callers used when Adam was all there was


def _state_already_made(opt, config=None) -> None:
    """An init_state_fn for optimizers megatron-core gives none: ensure_state made it."""


def fill_missing_init_state_fn(optimizer) -> None:
    """Upstream bug 4: megatron-core 0.16.1 builds SGD with ``init_state_fn=None``, and
    ``sharded_state_dict(is_loading=True)`` calls it unconditionally (TypeError on every
    load). The state it would create is :func:`ensure_state`'s, so a no-op stands in."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "init_state_fn") and opt.init_state_fn is None:
            opt.init_state_fn = _state_already_made


def _float16_sharded_state_dict(opt, model_sharded_state_dict, is_loading: bool = False,
                                metadata=None):
    """megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` (the same
    tensor keys) with the state ids mapped over every param of the torch optimizer's
    groups in torch's own numbering: a main (fp32) copy stands for its float16 model param,
    an fp32 model param for itself (upstream bug 5). The main (fp32) copies are saved as
    ``{group index: [...]}`` of the non-empty groups (an empty list inside a list cannot
    be loaded back); :func:`_float16_load_state_dict` reads them into the groups."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor,
        optim_state_to_sharding_state)

    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_dict = opt.state_dict()
    model_param_of = {id(main): model
                      for f16, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                      for model, main in zip(f16, mains)}
    optim_params = [p for group in opt.optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, [model_param_of.get(id(p), p) for p in optim_params])
    index = {}
    for i, p in enumerate(optim_params):  # torch's numbering: the first place of a param
        index.setdefault(id(p), i)
    missing = [i for i in sorted(set(index.values())) if i not in id_map]
    if missing:
        raise ValueError(f"optimizer params {missing} match no model sharded param")
    state_dict["fp32_from_fp16_params"] = {
        g: [make_sharded_optimizer_tensor(id_map[index[id(main)]], main,
                                          prefix="optimizer.state.fp32_param")
            for main in group]
        for g, group in enumerate(state_dict["fp32_from_fp16_params"]) if group}
    step = opt._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def _float16_load_state_dict(opt, state_dict) -> None:
    """megatron-core's ``load_state_dict``, the main params also given as
    :func:`_float16_sharded_state_dict` saves them (by group index)."""
    saved = state_dict.get("fp32_from_fp16_params")
    if isinstance(saved, dict):
        groups = opt.fp32_from_float16_groups
        if set(saved) - set(range(len(groups))) or any(
                len(saved.get(g, [])) != len(group) for g, group in enumerate(groups)):
            raise RuntimeError(
                f"saved main params per group {({g: len(v) for g, v in saved.items()})}, "
                f"the optimizer has {[len(group) for group in groups]}")
        state_dict = {**state_dict,
                      "fp32_from_fp16_params": [saved.get(g, []) for g in range(len(groups))]}
    type(opt).load_state_dict(opt, state_dict)


def fix_float16_sharded_state_dict(optimizer) -> None:
    """Upstream bug 5: every ``Float16OptimizerWithFloat16Params`` inside ``optimizer``
    builds its sharded state dict with :func:`_float16_sharded_state_dict` and loads with
    :func:`_float16_load_state_dict` (instance attributes, so ChainedOptimizer's own
    handling around them stays upstream's)."""
    import types

    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, Float16OptimizerWithFloat16Params) and \
                getattr(opt, "optimizer", None) is not None:
            opt.sharded_state_dict = types.MethodType(_float16_sharded_state_dict, opt)
            opt.load_state_dict = types.MethodType(_float16_load_state_dict, opt)


def check_captured(optimizer, captured) -> None:
    """Every state entry the optimizers hold is one REFT captures: a key of the table
    (the step where the kind keeps it there) whose tensor is one of ``captured`` (the
    objects listed in the snapshot layout). Anything else appeared after the listing
    and would never be snapshotted: refused, naming the optimizer and the key."""
    ids = {id(t) for t in captured}
    for opt in torch_optimizers(optimizer):
        _check_one(opt, ids)


def _check_one(opt, ids: set) -> None:
    kind = kind_of(opt)
    for group in opt.param_groups:
        keys = kind.tensor_keys(group)
        allowed = set(keys) | ({"step"} if kind.step_in == "param" else set())
        for j, p in enumerate(group["params"]):
            for key, value in opt.state.get(p, {}).items():
                if key not in allowed or (key in keys and id(value) not in ids):
                    raise UnsupportedOptimizer(
                        f"{_class_name(opt)} holds state {key!r} (param {j} of its group) "
                        "that REFT's snapshot layout does not: it was created after the "
                        "layout was listed and would never be snapshotted")


class FirstStepCheck:
    """:func:`check_captured` run once, right after each torch optimizer's first step
    (its own step hooks), where lazily created state would have appeared. A subclass
    whose step() calls a hooked super().step() runs the hooks twice, nested: the check
    waits for the outermost step to return. The hooks stay registered (removing one
    inside torch's hook loop would mutate the dict being iterated): a dict lookup per
    later step."""

    def __init__(self, optimizer, captured):
        self.ids = {id(t) for t in captured}
        self.depth: dict = {}  # id(torch optimizer) -> nesting of its running step()
        self.checked: set = set()
        self.handles = []
        for opt in torch_optimizers(optimizer):
            self.handles.append(opt.register_step_pre_hook(self._pre))
            self.handles.append(opt.register_step_post_hook(self._post))

    def _pre(self, opt, args, kwargs) -> None:
        self.depth[id(opt)] = self.depth.get(id(opt), 0) + 1

    def _post(self, opt, args, kwargs) -> None:
        self.depth[id(opt)] = depth = self.depth.get(id(opt), 1) - 1
        if depth == 0 and id(opt) not in self.checked:
            self.checked.add(id(opt))
            _check_one(opt, self.ids)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---- step counts: saved per optimizer kind --------------------------------------------
def optimizer_steps(optimizer) -> list:
    """The step count of each torch optimizer, as its kind keeps it: Adam's per-param
    step tensors as one number (None where it has no state yet), FusedAdam's per-group
    steps as ``{"group_steps": [...]}``, None for optimizers that keep none (SGD).

    All params of one Adam step together, so one number each; a disagreement means the
    state is already corrupt (bug 3) and is reported instead of saved.
    """
    steps = []
    for opt in torch_optimizers(optimizer):
        kind = kind_of(opt)
        if kind.step_in == "param":
            values = {float(st["step"]) for st in opt.state.values() if "step" in st}
            if len(values) > 1:
                raise RuntimeError(f"Adam params disagree on their step count: {sorted(values)}")
            steps.append(values.pop() if values else None)
        elif kind.step_in == "group":
            steps.append({"group_steps": [None if g.get("step") is None else int(g["step"])
                                          for g in opt.param_groups]})
        else:
            steps.append(None)
    return steps


def set_optimizer_steps(optimizer, steps: list) -> None:
    """Put saved step counts back: every Adam param its own step tensor, every
    FusedAdam group its step (removed where none was saved: before step 1)."""
    opts = torch_optimizers(optimizer)
    if len(steps) != len(opts):
        raise RuntimeError(f"saved optimizer steps for {len(steps)} optimizers, "
                           f"have {len(opts)}")
    for opt, step in zip(opts, steps):
        kind = kind_of(opt)
        if kind.step_in == "group":
            saved = (step or {}).get("group_steps") or [None] * len(opt.param_groups)
            if len(saved) != len(opt.param_groups):
                raise RuntimeError(f"saved {len(saved)} group steps for "
                                   f"{_class_name(opt)}, it has {len(opt.param_groups)}")
            for group, value in zip(opt.param_groups, saved):
                if value is None:
                    group.pop("step", None)
                else:
                    group["step"] = int(value)
            continue
        if step is None or kind.step_in != "param":
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                old = st.get("step")
                st["step"] = (torch.full((), float(step), dtype=old.dtype, device=old.device)
                              if torch.is_tensor(old) and old.device.type != "cpu"
                              else torch.tensor(float(step), dtype=torch.float32))


adam_steps, set_adam_steps = optimizer_steps, set_optimizer_steps  # the older names


def load_state_dict_in_place(optimizer, state_dict) -> None:
    """``optimizer.load_state_dict`` that keeps every Adam state tensor object.

    torch's ``Optimizer.load_state_dict`` (under megatron's non-distributed optimizers)
    builds new moment tensors, so anything that captured the old ones - REFT's snapshot
    layout is built when its session opens, before the persistent load - would go on
    copying tensors the optimizer no longer uses: every later snapshot would hold the
    moments of before the load. The loaded values are copied into the tensors that were
    there, which are then put back."""
    before = [{k: v for k, v in st.items() if torch.is_tensor(v)}
              for _, st in main_params_and_states(optimizer)]
    optimizer.load_state_dict(state_dict)
    after = list(main_params_and_states(optimizer))
    if len(after) != len(before):
        return  # a different param set: nothing captured can be meant to survive
    for old, (_, st) in zip(before, after):
        for key, tensor in old.items():
            new = st.get(key)
            if (torch.is_tensor(new) and new is not tensor and new.shape == tensor.shape
                    and new.dtype == tensor.dtype):
                tensor.copy_(new)
                st[key] = tensor
