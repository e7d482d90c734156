"""Each package's public face without import cost (PEP 562).

A package's ``__init__`` lists what it offers, module -> names, and binds
``__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)``: ``from reft_ext.store import
SnapshotStore`` imports ``reft_ext.store.slots`` on first use only, so what plain Python
tools need (the node watcher, the status table, the planner) never pulls in torch
through an ``__init__``. Exported names never equal a submodule's name (the import system
binds submodules as package attributes, which would shadow the export)."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """``(__all__, __getattr__)`` for ``package``: ``exports`` maps each submodule
    (relative to ``package``) to the public names it defines."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(importlib.import_module(package), name, value)  # next access is direct
        return value

    return sorted(where), __getattr__
