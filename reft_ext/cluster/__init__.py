"""Watching the job: node status files, watcher and flush, heartbeats and hang detection, health checks."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "NodeSignals": "status",
    "Heartbeat": "heartbeat",
    "HangMonitor": "heartbeat",
    "HealthConfig": "health_config",
    "run_health_check": "health",
    "spawn": "watcher",
    "mark_unhealthy": "shrink",
    "leave_job": "shrink",
    "hand_over": "shrink",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
