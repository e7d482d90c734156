"""The part of a rank's REFT-save state that REFT-load reads, in one place.

REFT-load used to reach into :class:`~reft_ext.save.snapshotter.ReftSnapshotter` some fifty
times (its adapter, group size, member index, regions, AOR owner ...). It now takes a
:class:`SnapshotView` built once from the snapshotter (:meth:`SnapshotView.of`), so
reft_ext/load depends on these names only, and what it may touch is visible here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from reft_ext.load.inventory import SlotFormat
from reft_ext.load.planning import JobFacts
from reft_ext.protect.schemes import Protection
from reft_ext.state.layout import StateLayout
from reft_ext.state.regions import Region
from reft_ext.store.slots import SnapshotStore


@dataclass(frozen=True)
class SnapshotView:
    rank: int
    world_size: int
    dp_ranks: list[int]            # this rank's sharding group; member d = dp_ranks[d]
    groups: list[list[int]]        # every sharding group of the job
    dp_group: Any                  # process group of the sharding group
    control_group: Any             # world-wide group for agreement
    member: int                    # this rank's index in its group
    D: int                         # the group's size
    layout: StateLayout            # where the state's bytes live in the model
    protection: Protection         # the group's scheme (encode/plan/recover)
    regions: dict[Region, tuple[int, int]]  # region -> (offset, length) in a slot
    nbytes: int                    # a slot's size
    store: SnapshotStore           # this rank's slots in its failure domain
    aor_owner: Any                 # (AOR) this rank's OwnerShard: spec, unpack_state; or None
    set_meta: Callable[[dict], None]  # the trainer's metadata (RNG, counters) setter
    job_id: str
    shm_dir: str
    ranks_per_node: int = 1        # consecutive ranks per failure domain (the placement)
    local_commits: bool = True     # commit pointers moved without a collective (--reft-keep >= 3)

    @classmethod
    def of(cls, s) -> "SnapshotView":
        """The view of a ReftSnapshotter (the one place load/ reads its attributes)."""
        a = s.a
        return cls(rank=a.rank, world_size=a.world_size, dp_ranks=a.dp_ranks,
                   groups=a.all_dp_groups, dp_group=a.dp_group, control_group=a.control_group,
                   member=s.member, D=s.D, layout=s.layout, protection=s.protection,
                   regions={Region(k): tuple(v) for k, v in s.regions.items()},
                   nbytes=s.nbytes, store=s.store,
                   aor_owner=s.aor.owner if s.aor is not None else None,
                   set_meta=a.set_meta, job_id=s.cfg.job_id, shm_dir=s.cfg.shm_dir,
                   ranks_per_node=s.cfg.ranks_per_node, local_commits=s.cfg.local_commits)

    @property
    def group_index(self) -> int:
        return self.groups.index(self.dp_ranks)

    @property
    def facts(self) -> JobFacts:
        return JobFacts(self.groups, self.protection.name, self.layout.owned.nbytes > 0,
                        self.aor_owner is not None, self.ranks_per_node)

    @property
    def slot_format(self) -> SlotFormat:
        return SlotFormat(self.layout.signature(), self.nbytes, self.protection.name)
