"""REFT extension library: snapshots, protection (ARC/AEC/AOR) and reload.

A library with small interfaces; it never imports ``megatron.training``. A trainer needs
two names: ``from reft_ext import ReftSession, ReftConfig`` (reft_ext/session.py,
reft_ext/config.py). They are imported on first use (PEP 562), so ``import reft_ext``
(the planner, the node watcher, the launcher's clean-up) does not pull in torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "ReftConfig": "reft_ext.config",
    "ReftConfigError": "reft_ext.config",
    "ReftSession": "reft_ext.session",
    "DisabledSession": "reft_ext.session",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reft_ext' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips __getattr__
    return value
