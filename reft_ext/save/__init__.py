"""Taking a snapshot: the snapshotter, its schedules (end-of-iteration, host thread, HAS) and pipeline bubbles."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "ReftSnapshotter": "snapshotter",
    "StateAdapter": "snapshotter",
    "reft_print": "snapshotter",
    "Schedule": "schedules",
    "make_schedule": "schedules",
    "plan_tiers": "tiers",
    "tier_split": "bubbles",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
