"""Optimizer state inside megatron optimizers: what REFT captures.

REFT lists its snapshot layout once, before step 1, so every state tensor an optimizer
would create lazily inside ``step()`` is created first (:func:`ensure_state`), per kind
from one table (:data:`KNOWN_KINDS`); an optimizer not in it is refused by name, and
after the first step :class:`FirstStepCheck` refuses any state the layout missed.

The table of kinds is ``optimizer_kinds.py``; the fixes a checkpoint's save and resume
need (megatron-core's upstream bugs, the step counts saved per kind) are
``optimizer_checkpoint_fixes.py``. Their names are importable from here too, as before
this module was split (the trainer, tests, tools and benchmarks import them from here).
"""

from __future__ import annotations

# the kinds and the checkpoint fixes, importable from this module as before it was split
from megatron.training.optimizer_checkpoint_fixes import (  # noqa: F401
    adam_steps, fill_missing_init_state_fn, fix_float16_sharded_state_dict,
    load_state_dict_in_place, optimizer_steps, set_adam_steps, set_optimizer_steps)
from megatron.training.optimizer_kinds import (  # noqa: F401
    BUILT_BY, KNOWN_KINDS, OptimizerKind, UnsupportedOptimizer, _class_name, capturable,
    kind_named, kind_of, main_params_and_states, torch_optimizers)


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

