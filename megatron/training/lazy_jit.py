"""Defer megatron-core's ``jit_fuser`` (``torch.compile``) to the first call.

megatron-core binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates its
fusion kernels with it at import time (``megatron/core/fusions/*.py``). Decorating is
enough to make torch import ``torch._dynamo`` and ``torch._inductor``: a large share of
every rank's start-up (docs/foundation.md has the figures), for kernels that a CPU run
never calls (every fusion is off there) and that a GPU run compiles on first call anyway.

``install()`` registers a meta-path finder that, right after ``megatron.core.jit`` has
executed, replaces its ``jit_fuser`` by :func:`lazy_compile`: the same
``torch.compile(fn, **kwargs)``, made when the kernel is first called instead of when it
is defined. Nothing else of torch or megatron-core changes. It must run before
``megatron.core`` is imported (``megatron/training/__init__.py`` does it); if megatron-core
is already imported it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys

TARGET = "megatron.core.jit"


def lazy_compile(model=None, **kwargs):
    """``torch.compile`` with the compile (and its imports) at the first call. Modules
    are compiled at once: an ``OptimizedModule`` is not a plain function to wrap."""
    if model is None:  # used as @jit_fuser(mode=...)
        return lambda fn: lazy_compile(fn, **kwargs)
    import torch

    if isinstance(model, torch.nn.Module):
        return torch.compile(model, **kwargs)
    compiled = None

    @functools.wraps(model)
    def run(*args, **kw):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(model, **kwargs)
        return compiled(*args, **kw)

    return run


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` through the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_defer(module):
            exec_module(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = lazy_compile

        loader.exec_module = exec_and_defer  # this spec's own loader instance
        return spec


def install() -> None:
    if TARGET in sys.modules or any(isinstance(f, _DeferJitFuser) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferJitFuser())
