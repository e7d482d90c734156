"""Process groups that outlive a generation of an in-process restart.

A torch ``ProcessGroup`` is bound to its communicator for life: a failed generation's
gloo sockets (or NCCL communicator) are aborted, and every object holding the group (a
model's module, DDP's reducer, a tuple, a closure, TransformerEngine in C++) then holds
a dead group. Instead of finding those holders (``rebind`` walks the heap and cannot
reach tuples or C++), the groups made here have a backend that forwards to an inner
communicator (``reft_ext._groups``, csrc/group_backend.cpp): a restart aborts the inner
one and :func:`reconfigure` gives every group the next generation's, rendezvoused on
that generation's store prefix, as torchft's reconfigurable groups do. The objects stay.

The replacement of a lost rank is a new process: it makes its groups afresh on the
same generation's store, through the same ``init_process_group``/``new_group`` calls,
so its group names and store prefixes are those the survivors reconfigure with
(:func:`store_for`). Groups made after start-up (REFT's own) are destroyed and made
again by their owners each generation, in the same order on every rank; the name
counter is set back to where start-up left it so that those names agree too.

Only gloo groups here (``reft_gloo``); NCCL groups keep the rebinding path until this
is exercised on a GPU.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch

BACKEND = "reft_gloo"  # the registered backend name (torch lower-cases it)
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"  # torch's switch, read as each gloo group is made
ENV_EAGER_MAX = "REFT_GLOO_EAGER_MAX"
# groups of up to this many ranks connect every pair when made (at most 63 connections
# per rank, whatever the job's size); larger ones (the job-wide control groups) on first
# use: a full mesh is W-1 sockets per rank and W^2 store reads per generation
EAGER_MAX = 64
_env_lock = threading.Lock()

_module = None
_why_not = ""
_registered = False
_base_count: int | None = None  # torch's group-name counter after start-up


def native():
    """reft_ext._groups, or None (then :func:`why_unavailable` says why)."""
    global _module, _why_not
    if _module is None and not _why_not:
        try:
            from reft_ext import _groups  # noqa: PLC0415 - optional, torch-version bound
            _module = _groups
        except ImportError as exc:
            _why_not = (f"reft_ext._groups is not built ({exc}); reinstall with a C++ "
                        f"compiler (pip install -e .) to keep process groups across "
                        f"restarts")
    return _module


def why_unavailable() -> str:
    native()
    return _why_not


def eager_max() -> int:
    """The largest group connected in full when made (``REFT_GLOO_EAGER_MAX``)."""
    raw = os.environ.get(ENV_EAGER_MAX, "")
    try:
        return int(raw) if raw else EAGER_MAX
    except ValueError:
        raise ValueError(f"{ENV_EAGER_MAX}={raw!r}: must be a whole number of ranks") \
            from None


def gloo_group(store, rank: int, size: int, timeout: datetime.timedelta):
    """A ProcessGroupGloo, its pairs connected now up to :func:`eager_max` ranks and on
    first use beyond. Why not lazily everywhere: a survivor whose first message to a
    peer that died before it is the pair's listening end waits for gloo's timeout, which
    nothing can wake (gloo #520; the supervisor's abort timeout then replaces it as a
    new process). A user's own TORCH_GLOO_LAZY_INIT applies to every group."""
    with _env_lock:  # the switch is process-wide: one group at a time
        if LAZY_GLOO in os.environ:
            return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
        os.environ[LAZY_GLOO] = "1" if size > eager_max() else "0"
        try:
            return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
        finally:
            del os.environ[LAZY_GLOO]


def _create(store, rank: int, size: int, timeout: datetime.timedelta):
    """torch's creator for ``reft_gloo``: gloo, wrapped."""
    return _module.wrap(gloo_group(store, rank, size, timeout), BACKEND)


def register() -> bool:
    """Make ``reft_gloo`` a torch.distributed backend (once); False if not built."""
    global _registered
    if native() is None:
        return False
    if not _registered:
        torch.distributed.Backend.register_backend(BACKEND, _create, devices=["cpu"])
        _registered = True
    return True


def backend_for(requested: str | None) -> str | None:
    """The backend to ask for instead of ``requested`` once registered: gloo ->
    reft_gloo; anything else (None: the default group's, which is already ours) as is."""
    return BACKEND if _registered and requested == "gloo" else requested


def is_persistent(pg) -> bool:
    """Does ``pg`` forward to a replaceable communicator?"""
    if _module is None or pg is None:
        return False
    try:
        return bool(_module.is_delegating(pg._get_backend(torch.device("cpu"))))
    except (RuntimeError, ValueError):
        return False


def persistent_groups() -> list:
    """This process's persistent groups in creation order (the default group first)."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in c10d._world.pg_names if is_persistent(pg)]


def mark_started() -> None:
    """Start-up made its groups: later ones are the per-generation kind."""
    from torch.distributed import distributed_c10d as c10d

    global _base_count
    _base_count = c10d._world.group_count


def store_for(pg, init_store) -> torch.distributed.PrefixStore:
    """The store ``pg`` would get if it were made now by ``init_process_group(store=
    init_store)`` and new_group (torch 2.13: the default group's name as prefix, every
    other group's name under it; "default_pg" only when no store is given, which the
    in-process supervisor always does)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    root = torch.distributed.PrefixStore(f"{c10d._world.pg_names[world]}/", init_store)
    if pg is world:
        return root
    return torch.distributed.PrefixStore(f"{c10d._world.pg_names[pg]}/", root)


def reconfigure(init_store, timeout: datetime.timedelta) -> int:
    """Give every persistent group a communicator of the generation whose processes
    call ``init_process_group(store=init_store)``. Each blocks until the group's other
    members do the same, in the same order (creation order on every rank). Returns how
    many groups."""
    from torch.distributed import distributed_c10d as c10d

    groups, retired = persistent_groups(), []
    for pg in groups:
        store = store_for(pg, init_store)
        backend = pg._get_backend(torch.device("cpu"))
        inner = gloo_group(torch.distributed.PrefixStore("cpu/", store), backend.rank(),
                           backend.size(), timeout)
        retired.append(_module.inner(backend))
        _module.set_inner(backend, inner)
        name, _ = c10d._world.pg_map[pg]
        c10d._world.pg_map[pg] = (name, store)  # new_group reads the default's
    if _base_count is not None:
        c10d._world.group_count = _base_count  # later groups: the replacement's names
    _retire(retired)
    return len(groups)


_retiring: threading.Thread | None = None


def _retire(backends: list) -> None:
    """Drop the failed generation's communicators on a thread of their own: a gloo
    backend's destructor joins its worker threads (~6 ms each here), which the peers
    waiting in the next group's rendezvous need not wait for."""
    global _retiring
    _retiring = threading.Thread(target=backends.clear, name="reft-retire-groups",
                                 daemon=True)
    _retiring.start()


def wait_retired(timeout: float = 30.0) -> None:
    """The failed generation's communicators are gone (long since, by the end of a
    restart: this only makes the restart's resource count exact)."""
    if _retiring is not None:
        _retiring.join(timeout)


def generation_of(pg) -> int:
    """How many times ``pg``'s communicator was replaced."""
    return int(_module.generation(pg._get_backend(torch.device("cpu"))))
