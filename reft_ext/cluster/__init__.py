"""Watching the job: node status files, watcher and flush, heartbeats and hang detection, health checks."""
