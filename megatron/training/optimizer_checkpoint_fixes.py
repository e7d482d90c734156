"""What saving and resuming megatron optimizers needs fixed: megatron-core's upstream bugs
around its optimizers' checkpoints, and the step counts REFT saves per optimizer kind.

Without apex/TransformerEngine, megatron-core 0.16.1 runs torch's Adam inside its
optimizers, and resuming it has three upstream bugs (docs/foundation.md), SGD a fourth:

1. ``DistributedOptimizer.state_dict()`` reads ``state["step"]`` of every param, so a
   fresh optimizer (no state yet) cannot even build its load state dict.
   -> :func:`~megatron.training.optimizer_state.ensure_state` creates zero moments and a
   step per param first.
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

Apart from the capture (``optimizer_state.py``): these run around a checkpoint's save and
load (``checkpointing.py``) and REFT's restore (``train_state.py``), never on the snapshot
path, and the float16 fix reads megatron-core's dist_checkpointing internals.
"""

from __future__ import annotations

import torch

from megatron.training.optimizer_kinds import (_class_name, kind_of, main_params_and_states,
                                               torch_optimizers)


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

