"""Taking a snapshot: the snapshotter, its schedules (end-of-iteration, host thread, HAS) and pipeline bubbles."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "snapshotter": ("ReftSnapshotter", "StateAdapter", "reft_print"),
    "schedules": ("Schedule", "make_schedule"),
    "tiers": ("plan_tiers",),
    "bubbles": ("tier_split",),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
