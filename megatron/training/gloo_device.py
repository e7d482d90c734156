"""gloo with device tensors: several ranks on one GPU (tools/gpu_multirank.py). NCCL
refuses two ranks on one device; gloo accepts device tensors for some collectives only,
and its TCP transport would read a device pointer as host memory for the others. With
``--distributed-backend gloo`` on a CUDA machine the trainer installs this module's
staging (initialize.py): each collective megatron-core calls on a gloo group with device
tensors runs on host copies (device -> host, the collective, host -> device, in the
caller's stream order), synchronously; an ``async_op`` caller gets a finished handle.
Inside megatron-core's ``_coalescing_manager`` the staged calls run at once, so nothing is
queued for the manager to coalesce (its handle then waits for nothing). Host tensors
(REFT's own groups, a CPU run) pass through untouched. Slow, and meant to be: a test
mode of the device paths, not a way to train."""

from __future__ import annotations

import collections
import functools
import inspect

import torch
import torch.distributed as dist

# the collectives megatron-core's DDP, optimizer and tensor parallelism call, each with the
# argument it writes: only that one is copied back (an input may overlap it: ZeRO-1's
# reduce-scatter writes a view of its own input, and copying the input back over the
# output would undo the reduction). p2p is not staged: a staged irecv would block where
# a batched exchange expects it posted.
OUTPUTS = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
           "reduce_scatter_tensor": "output", "_reduce_scatter_base": "output",
           "reduce_scatter": "output", "all_gather_into_tensor": "output_tensor",
           "_all_gather_base": "output_tensor", "all_gather": "tensor_list",
           "all_to_all_single": "output"}
STAGED = tuple(OUTPUTS)
# where megatron-core captured one of them by name at import (dist_all_gather_func,
# dist_reduce_scatter_func, ...): every module attribute that *is* a collective of
# STAGED is swapped, found by identity rather than listed (a new alias is not missed)
ALIAS_PACKAGES = ("megatron.core",)
_originals: dict = {}
# collective name -> calls run on host copies (tests/workers/staged_trainer.py prints it)
staged_calls: collections.Counter = collections.Counter()


class _Done:
    """The handle of a collective that already ran (what ``async_op=True`` gets)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _to_host(x, predicate, moved: list | None):
    """``x`` with the tensors ``predicate`` marks replaced by host copies; (host,
    original) pairs in ``moved`` to copy back (None: an input, nothing copied back).
    Lists of tensors too (all_gather's)."""
    if isinstance(x, torch.Tensor) and predicate(x):
        h = x.detach().to("cpu", copy=True)
        if moved is not None:
            moved.append((h, x))
        return h
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) and predicate(t)
                                            for t in x):
        return type(x)(_to_host(t, predicate, moved) for t in x)
    return x


def staged(fn, predicate=_on_device, output: str | None = None):
    """``fn`` (a torch.distributed collective) run on host copies of its device tensors
    when its group is gloo; only ``output`` (the argument it writes, by name; default
    from :data:`OUTPUTS`) is copied back. ``predicate`` says which tensors to stage
    (tests stage host tensors to check the copies on a machine without a device)."""
    sig = inspect.signature(fn)
    name = getattr(fn, "__name__", "")
    output = output or OUTPUTS.get(name)
    if output not in sig.parameters:
        raise ValueError(f"gloo_device.staged: {name or fn!r} has no output argument "
                         f"{output!r} (its parameters: {list(sig.parameters)})")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        values = list(bound.arguments.values())
        flat = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v])]
        if not any(predicate(t) for t in flat):
            return fn(*args, **kwargs)
        group = bound.arguments.get("group")
        if "gloo" not in str(dist.get_backend(group)):  # (reft_gloo in-process too)
            return fn(*args, **kwargs)
        async_op = bool(bound.arguments.pop("async_op", False))
        staged_calls[name] += 1
        moved: list = []
        for arg, value in list(bound.arguments.items()):
            bound.arguments[arg] = _to_host(value, predicate,
                                            moved if arg == output else None)
        # inside a coalescing manager torch would only queue the call (on the host
        # copies): run it now, outside the manager's queue, which stays as it was
        state = dist.distributed_c10d._world.pg_coalesce_state
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        queued = state.pop(pg, None)
        try:
            work = fn(*bound.args, **bound.kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
        finally:
            if queued is not None:
                state[pg] = queued
        for host, dev in moved:
            dev.copy_(host)
        return _Done() if async_op else None
    run.__wrapped_collective__ = fn
    return run


def install(predicate=_on_device) -> list[str]:
    """Stage the collectives of :data:`STAGED` (torch.distributed and megatron-core's
    aliases of them); idempotent. Returns what was staged. ``predicate``: which
    tensors (tests/workers/staged_trainer.py stages host ones)."""
    done = []
    for name in STAGED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        if name not in _originals:
            _originals[name] = fn
            setattr(dist, name, staged(fn, predicate))
        done.append(name)
    done += _swap_aliases({id(f): getattr(dist, n) for n, f in _originals.items()})
    return done


def _swap_aliases(replace: dict) -> list[str]:
    """Point every attribute of a loaded megatron-core module that is a key of
    ``replace`` (by id) at its value; the aliases swapped (``module.attr``). Modules
    imported later read torch.distributed's (staged) attribute themselves."""
    import sys

    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(ALIAS_PACKAGES):
            continue
        for attr, current in list(vars(mod).items()):
            if callable(current) and id(current) in replace:
                setattr(mod, attr, replace[id(current)])
                done.append(f"{mod_name}.{attr}")
    return done


def uninstall() -> None:
    """Put the originals back (tests)."""
    _swap_aliases({id(getattr(dist, n)): f for n, f in _originals.items()})
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()
