"""Adam state inside megatron optimizers, and the fixes resume needs with torch Adam.

Without apex/TransformerEngine, megatron-core 0.16.1 runs torch's Adam inside its
optimizers, and resuming it has three upstream bugs (docs/foundation.md):

1. ``DistributedOptimizer.state_dict()`` reads ``state["step"]`` of every param, so a
   fresh optimizer (no state yet) cannot even build its load state dict.
   -> :func:`ensure_adam_state` creates zero moments and a step per param first.
2. ``load_parameter_state_from_dp_reshardable`` copies into fp32 leaf params without
   ``no_grad``. -> checkpointing.py loads under ``torch.no_grad()``.
3. ``load_state_dict`` assigns ONE shared ``step`` tensor to all params (torch Adam then
   increments it once per param per step) and the step is saved as a non-persistent
   object, so the fresh 0 wins. -> we save the step ourselves (:func:`adam_steps`) and
   give every param its own tensor again (:func:`set_adam_steps`).
"""

from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list:
    """The torch.optim optimizers inside a megatron (chained) optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def main_params_and_states(optimizer):
    """(main param, its Adam state dict) in a fixed order over all param groups."""
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield p, opt.state.get(p, {})


def ensure_adam_state(optimizer) -> None:
    """Create zero Adam state (moments and an own step tensor) where a param has none."""
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                if "step" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "exp_avg_sq" not in st:
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_steps(optimizer) -> list:
    """The Adam step count of each torch optimizer (None where it has no state yet).

    All params of one optimizer step together, so one number each; a disagreement means
    the state is already corrupt (bug 3) and is reported instead of saved.
    """
    steps = []
    for opt in torch_optimizers(optimizer):
        values = {float(st["step"]) for st in opt.state.values() if "step" in st}
        if len(values) > 1:
            raise RuntimeError(f"Adam params disagree on their step count: {sorted(values)}")
        steps.append(values.pop() if values else None)
    return steps


def set_adam_steps(optimizer, steps: list) -> None:
    """Give every param its own step tensor with the saved value."""
    opts = torch_optimizers(optimizer)
    if len(steps) != len(opts):
        raise RuntimeError(f"saved Adam steps for {len(steps)} optimizers, have {len(opts)}")
    for opt, step in zip(opts, steps):
        if step is None:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)


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
