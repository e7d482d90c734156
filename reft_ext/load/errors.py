"""Why host memory cannot serve a restart, as exceptions.

REFT-load's planners (reft_ext/load/planning.py) raise these instead of returning
``(None, reason)``; ``str(error)`` is the reason exactly as the ``[REFT] ... not possible:
<reason>`` line prints it, so callers that only log and fall back to the persistent
checkpoint need nothing but ``except RecoveryError``. Callers that decide something
(the trainer, tests) look at the type and its fields instead of parsing the sentence.

Two levels: :class:`Unrestorable` says why ONE iteration cannot be rebuilt (raised by the
per-iteration plan, collected by the choice of iteration); the others say why the
restart as a whole does not come from host memory.
"""

from __future__ import annotations

from reft_ext.config import ReftConfigError


class RecoveryError(Exception):
    """Host memory cannot serve this restart; the caller falls back (persistent
    checkpoint, or a start from scratch)."""

    @property
    def reason(self) -> str:
        return str(self)


# ---- one iteration ----------------------------------------------------------------------
class Unrestorable(RecoveryError):
    """One candidate iteration cannot be rebuilt (an older one may still be)."""


class BeyondProtection(Unrestorable):
    """A sharding group lost more slices than its protection scheme can rebuild."""

    def __init__(self, ranks: list[int], lost: list[int], scheme: str):
        self.ranks, self.lost, self.scheme = list(ranks), list(lost), scheme
        super().__init__(f"sharding group {self.ranks} lost the slices of ranks {self.lost}, "
                         f"more than --reft-protect {scheme} can rebuild")


class OwnedStateLost(Unrestorable):
    """Ranks lost their ZeRO-1 shard and no AOR replica of it survived."""

    def __init__(self, lost: list[int], aor: bool):
        self.lost, self.aor = list(lost), aor
        super().__init__(f"ranks {self.lost} lost their ZeRO-1 optimizer shards " + (
            "and their holders' AOR replicas" if aor else
            "(no host replica without --reft-protect aor)"))


class NoMetadataSource(Unrestorable):
    """Every slice of a group is rebuilt, none restored from a member's own memory: no
    member's snapshot is trusted for the metadata (RNG, counters) the others take."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        super().__init__(f"sharding group {self.ranks} restores no slice from a member's own "
                         f"memory, whose metadata (RNG, counters) the others would take")


class MixedOldGroups(Unrestorable):
    """(reshard) A new sharding group's members come from different old groups."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        super().__init__(f"ranks {self.ranks} come from different sharding groups of the "
                         f"old job")


class SlicesLeft(Unrestorable):
    """(reshard) Old slices left with the excluded nodes and no survivor holds a copy."""

    def __init__(self, lost: list[int], old_group: list[int], scheme: str):
        self.lost, self.old_group, self.scheme = list(lost), list(old_group), scheme
        super().__init__(f"the slices of old ranks {self.lost} (sharding group "
                         f"{self.old_group}) left with the excluded node(s) and no survivor "
                         f"holds a copy (--reft-protect {scheme})")


# ---- the restart as a whole -------------------------------------------------------------
def _cited(skipped: dict[int, Unrestorable], n: int = 2) -> list[str]:
    """The first ``n`` (newest) skipped iterations, as the lines cite them."""
    return [f"iteration {it}: {why}" for it, why in list(skipped.items())[:n]]


class NoSnapshot(RecoveryError):
    def __init__(self):
        super().__init__("no snapshot in host memory")


class NoRestorableIteration(RecoveryError):
    """No candidate iteration can be rebuilt. ``skipped``: iteration -> why, newest first
    (the message cites the first two)."""

    def __init__(self, skipped: dict[int, Unrestorable]):
        self.skipped = dict(skipped)
        super().__init__("; ".join(_cited(self.skipped)))


class PersistentIsNewer(RecoveryError):
    """The persistent checkpoint is newer than the newest iteration host memory can
    rebuild: it wins. ``skipped``: the newer iterations of host memory that could not
    be rebuilt, and why (cited after the message)."""

    def __init__(self, persistent: int, iteration: int,
                 skipped: dict[int, Unrestorable] | None = None):
        self.persistent, self.iteration = persistent, iteration
        self.skipped = dict(skipped or {})
        super().__init__(f"the persistent checkpoint (iteration {persistent}) is newer than "
                         f"host memory (iteration {iteration})" +
                         "".join(f"; {r}" for r in _cited(self.skipped)))


class OtherWorldSize(RecoveryError):
    """Host memory holds only snapshots of a job of another size (an elastic shrink,
    docs/nodes.md); REFT-load does not cut slices for another data-parallel size."""

    def __init__(self, old: tuple[int, int], world_size: int, D: int):
        self.old, self.world_size, self.D = tuple(old), world_size, D
        super().__init__(f"host memory holds snapshots of a job of {old[0]} ranks "
                         f"(data-parallel size {old[1]}), this job has {world_size} ranks "
                         f"(data-parallel size {D}): REFT-load does not reshard snapshots to "
                         f"another data-parallel size")


class MissingHandover(RecoveryError):
    """(reshard) Some ranks do not know their place in the old job."""

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        super().__init__(f"ranks {self.ranks} have no note of their place in the old job")


class NoCommonIteration(RecoveryError):
    """(reshard) No iteration of the old job is held by every survivor."""

    def __init__(self, why: str = ""):
        super().__init__(why or "the survivors hold no common iteration of the old job")


class IdentityMismatch(RecoveryError, ReftConfigError):
    """Host memory or the flush directory holds another run's state (same --reft-job-id,
    another seed/model/data; reft_ext/state/identity.py). Not a fallback: a
    configuration error that stops the job (hence also a ReftConfigError)."""
