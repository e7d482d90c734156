"""megatron-core's notes that Transformer Engine or Apex is missing ("Apex is not
installed. Falling back to Torch Norm", one per module that checks, on every rank, before
Megatron's argument table) become one line at start-up, from rank 0, that says what is
missing and what is used instead.

:func:`install` mutes exactly those warnings (by their wording, from megatron-core's
modules only; every other warning still shows) and must run before megatron-core is
imported: megatron/training/__init__.py calls it. :func:`summary` then reads what
megatron-core chose from its own module flags, so the line is right even where an import
happened under another filter (arguments.py and path_checks.py import under
``catch_warnings``).
"""

from __future__ import annotations

import importlib.util
import warnings

# megatron-core 0.16's fallback warnings, all emitted once per module at import time
MESSAGES = (
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Transformer Engine and Apex are not installed\. Falling back to ",
)
MODULES = r"megatron\.core(\.|$)"  # where they are raised (warnings' "module" field)


def install() -> None:
    """Mute the fallback warnings (idempotent: filterwarnings drops duplicates)."""
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=MODULES)


def _flag(module: str, name: str, default=None):
    """A module-level flag of megatron-core, or ``default`` where the module or the flag
    is not there (another megatron-core version: no line rather than a wrong one)."""
    try:
        return getattr(importlib.import_module(module), name, default)
    except ImportError:
        return default


def summary() -> str | None:
    """One line: the packages megatron-core missed and what it uses instead; None when
    it fell back on nothing."""
    missing = [name for name, mod in (("Transformer Engine", "transformer_engine"),
                                      ("Apex", "apex")) if importlib.util.find_spec(mod) is None]
    used = []
    if _flag("megatron.core.optimizer", "USING_PYTORCH_OPTIMIZER", False):
        used.append("torch.optim's AdamW/SGD")
    local = _flag("megatron.core.utils", "local_multi_tensor_applier")
    if local is not None and _flag("megatron.core.optimizer.clip_grads",
                                   "multi_tensor_applier") is local:
        used.append("its local multi-tensor kernels")
    if _flag("megatron.core.models.backends", "HAVE_APEX", True) is False:
        used.append("torch's norms")
    if not used:
        return None
    names = " and ".join(missing) or "Transformer Engine or Apex"
    verb = "are" if len(missing) > 1 else "is"
    listed = ", ".join(used[:-1]) + " and " + used[-1] if len(used) > 1 else used[0]
    return (f"megatron-core: {names} {verb} not installed, so it uses {listed} instead of "
            f"their fused ones")
