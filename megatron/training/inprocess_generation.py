"""This process's generation under the in-process supervisor (``--reft-restart
in-process``) and the process groups initialize_distributed made in it.

The lower half of the trainer's in-process restart: initialize.py calls
:func:`store_kwargs` and :func:`after_initialize` when it joins a generation, and
inprocess.py, which re-joins the next generation through initialize.py, reads the groups
recorded here to rebind them. Kept apart from inprocess.py so that neither of
initialize.py and inprocess.py imports the other's importer.
"""

from __future__ import annotations

import contextlib
import os

from reft_ext.cluster import groups, inprocess

_gen: inprocess.Generation | None = None
_persistent = False      # this generation's groups are reft_gloo: reconfigured, never remade
_base_groups: list = []  # this generation's groups as initialize_distributed made them
_base_desc: list = []    # their (name, ranks, backend): what must match across generations


def generation() -> inprocess.Generation | None:
    return _gen


def rejoining() -> bool:
    """Is this a later generation of an in-process restart (every rank of it, survivor
    or replacement, says the same)?"""
    return _gen is not None and _gen.gen >= 1


def replacing_trained_ranks() -> bool:
    """A replacement joining survivors that had trained (Generation.survivors_trained):
    its weight initialisation is skipped (seconds for a large model, every byte
    overwritten by the restore)."""
    return _gen is not None and _gen.survivors_trained()


def store_kwargs(timeout) -> dict:
    """init_process_group's store/rank/world under the in-process supervisor, else {}."""
    global _gen
    if not inprocess.enabled():
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if _gen is None:
        _gen = inprocess.Generation(rank, world)
    return dict(store=_gen.pg_store(timeout), rank=rank, world_size=world)


def group_backend(backend: str) -> str:
    """The backend of the process groups: under the supervisor, gloo becomes reft_gloo
    (groups kept across restarts, reft_ext/cluster/groups.py) where reft_ext._groups is
    built; elsewhere, and for NCCL, as asked (the restart then rebinds references)."""
    global _persistent
    if _gen is None or backend != "gloo":
        return backend
    if not groups.register():
        from reft_ext.report.events import emit

        emit("inprocess_groups", f"rank {_gen.rank}: {groups.why_unavailable()}; "
             f"restarts rebind process-group references instead", rank=_gen.rank)
        return backend
    _persistent = True
    return groups.BACKEND


def persistent() -> bool:
    """Are this process's start-up groups reconfigured by a restart (not remade)?"""
    return _persistent


@contextlib.contextmanager
def persistent_gloo(mpu):
    """megatron-core asks for its gloo twins by name (backend="gloo"): while it makes its
    groups, its create_group asks for reft_gloo instead, so those persist as well."""
    if not _persistent:
        yield
        return
    orig = mpu.create_group

    def create_group(*args, backend=None, **kwargs):
        return orig(*args, backend=groups.backend_for(backend), **kwargs)

    mpu.create_group = create_group
    try:
        yield
    finally:
        mpu.create_group = orig


def reconfigure(timeout) -> int:
    """A survivor's groups join the current generation: each gets a communicator on this
    generation's store (the replacements make theirs there); the abort watcher restarts.
    Returns how many groups."""
    n = groups.reconfigure(_gen.pg_store(timeout), timeout)
    _gen.watch()
    return n


def all_groups() -> list:
    """Every torch process group of this process, in creation order (the default first)."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_names)


def describe(groups: list) -> list:
    """(name, ranks, backend) of each group."""
    from torch.distributed import distributed_c10d as c10d

    return [(c10d._world.pg_names.get(g), tuple(c10d._world.pg_group_ranks.get(g, {})),
             g.name() if hasattr(g, "name") else "") for g in groups]


def after_initialize() -> None:
    """The groups initialize_distributed made (what inprocess.rebind maps), and the abort
    watcher of this generation."""
    global _base_groups, _base_desc
    _base_groups = all_groups()
    _base_desc = describe(_base_groups)
    if _persistent:
        groups.mark_started()
    if _gen is not None:
        _gen.watch()


def base_groups() -> list:
    return list(_base_groups)


def base_descriptions() -> list:
    """:func:`describe` of :func:`base_groups`, taken when they were made."""
    return list(_base_desc)
