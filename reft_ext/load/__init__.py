"""Getting state back. What REFT-load decides is pure (inventory.py: what each rank
holds; planning.py: which iteration, and where every slice, owned shard and metadata
come from; errors.py: why not); what it does is I/O and collectives (recover.py after a
restart, reshard.py after a shrink) over a narrow view of the snapshotter (view.py).
Beside them: fused.py (verify-and-load in one pass), flushed.py (the flushed tier),
rollback.py (loss-spike rollback)."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "errors": ("RecoveryError",),
    "planning": ("choose_iteration", "plan_recovery", "plan_reshard"),
    "inventory": ("take_inventory",),
    "view": ("SnapshotView",),
    "reshard": ("reshard_from_memory",),
    "flushed": ("import_flushed",),
    "fused": ("load_verified",),
    "rollback": ("RollbackConfig", "SpikeDetector"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
