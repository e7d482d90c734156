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

The same for other libraries' notes that every run printed (KNOWN): muted by message and
module, named in one ``[REFT]`` line (:func:`muted_line`).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

# megatron-core 0.16's fallback warnings, all emitted once per module at import time
MESSAGES = (
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Transformer Engine and Apex are not installed\. Falling back to ",
)
MODULES = r"megatron\.core(\.|$)"  # where they are raised (warnings' "module" field)


# Other libraries' notes that every run printed, each muted by its exact wording and the
# module that raises it (never a blanket filter: any other warning still shows), named in
# one [REFT] line at start-up (muted_line). (what, category, message, module, CPU only)
KNOWN = (
    ("megatron-core's zero_grad reading .grad of a non-leaf tensor", UserWarning,
     r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     r"megatron\.core\.optimizer\.optimizer$", False),
    ("torch 2.13's deprecation of reduce_scatter_tensor and all_gather_into_tensor "
     "(megatron-core's calls)", FutureWarning,
     r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     r"torch\.distributed\.c10d_logger$", False),
    ("torch's deprecation of ShardedTensor and of DCP's load_state_dict (megatron-core's "
     "dist_checkpointing)", FutureWarning,
     r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"torch\.distributed\.(checkpoint|_shard)\.", False),
    (None, FutureWarning,
     r"`load_state_dict` is deprecated and will be removed in future versions\. Please use "
     r"`load` instead", r"megatron\.core\.dist_checkpointing\.strategies\.torch$", False),
    ("megatron-core's CUDA_DEVICE_MAX_CONNECTIONS advice (a torch without CUDA)", UserWarning,
     r"When using (sequence parallelism|async grad allreduce) it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
     r"megatron\.core\.tensor_parallel\.layers$", True),
)
SHOW_ENV = "REFT_SHOW_LIBRARY_NOTES"  # =1: the KNOWN notes are not muted
_muted: list[str] = []


def install() -> None:
    """Mute the fallback warnings and the KNOWN notes (idempotent: filterwarnings drops
    duplicates)."""
    for message in MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=MODULES)
    if os.environ.get(SHOW_ENV) == "1":
        return
    cpu = None
    for what, category, message, module, cpu_only in KNOWN:
        if cpu_only:
            if cpu is None:
                import torch  # the wheel, not the device: no CUDA initialised at import

                cpu = torch.version.cuda is None and torch.version.hip is None
            if not cpu:
                continue
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        if what and what not in _muted:
            _muted.append(what)


def muted_line() -> str | None:
    """The one line that says which library notes install() muted (None: none)."""
    if not _muted:
        return None
    return (f"[REFT] muted by their exact wording (megatron/training/fallbacks.py; "
            f"{SHOW_ENV}=1 shows them): {'; '.join(_muted)}")


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
