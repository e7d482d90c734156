"""Taking a snapshot: the snapshotter, its schedules (end-of-iteration, host thread, HAS) and pipeline bubbles."""
