"""This process's generation under the in-process supervisor (``--reft-restart
in-process``) and the process groups initialize_distributed made in it.

The lower half of the trainer's in-process restart: initialize.py calls
:func:`store_kwargs` and :func:`after_initialize` when it joins a generation, and
inprocess.py, which re-joins the next generation through initialize.py, reads the groups
recorded here to rebind them. Kept apart from inprocess.py so that neither of
initialize.py and inprocess.py imports the other's importer.
"""

from __future__ import annotations

import os

from reft_ext.cluster import inprocess

_gen: inprocess.Generation | None = None
_base_groups: list = []  # this generation's groups as initialize_distributed made them
_base_desc: list = []    # their (name, ranks, backend): what must match across generations


def generation() -> inprocess.Generation | None:
    return _gen


def store_kwargs(timeout) -> dict:
    """init_process_group's store/rank/world under the in-process supervisor, else {}."""
    global _gen
    if not inprocess.enabled():
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if _gen is None:
        _gen = inprocess.Generation(rank, world)
    return dict(store=_gen.pg_store(timeout), rank=rank, world_size=world)


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
    if _gen is not None:
        _gen.watch()


def base_groups() -> list:
    return list(_base_groups)


def base_descriptions() -> list:
    """:func:`describe` of :func:`base_groups`, taken when they were made."""
    return list(_base_desc)
