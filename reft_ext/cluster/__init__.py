"""Watching the job: node status files, watcher and flush, heartbeats and hang detection, health checks."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "status": ("NodeSignals",),
    "heartbeat": ("Heartbeat", "HangMonitor"),
    "health_config": ("HealthConfig",),
    "health": ("run_health_check",),
    "watcher": ("spawn",),
    "shrink": ("mark_unhealthy", "leave_job", "hand_over", "write_handover", "take_handover"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
