"""The REFT flags of the recovery tests and the checks of what a recovery recorded
(tests/harness/events.py): which iteration each rank restored, from which source, or the
fall-back to the persistent checkpoint and why."""

from __future__ import annotations

import time

from tests.harness.events import Events

N = ["--train-iters", "6"]  # every recovery test's run length (failure-free ones shared)

# how a rank's slice came back: recover.py's Source values
OWN, REPLICA, PARITY = "own", "replica", "parity"


def reft(protect: str, ranks_per_node: int | None = 1) -> list[str]:
    """Snapshots every iteration under ``protect``; ``ranks_per_node`` 1 makes each rank
    its own failure domain under plain torchrun (None: the launcher's real nodes)."""
    rpn = [] if ranks_per_node is None else ["--reft-ranks-per-node", str(ranks_per_node)]
    return ["--reft-snapshot-every", "1", "--reft-protect", protect, *rpn]


def assert_recovered(events: Events, iteration: int, sources: dict[int, str],
                     aor_from: dict[int, int] | None = None) -> None:
    """Each rank of ``sources`` restored ``iteration`` from host memory, its slice from
    that source; a rank of ``aor_from`` its optimizer shard from that holder's AOR
    replica."""
    for rank, source in sources.items():
        match = {"iteration": iteration, "rank": rank, "source": source}
        if aor_from and rank in aor_from:
            match["aor_from"] = aor_from[rank]
        assert events.of("recovered", **match), \
            (match, events.of("recovered", rank=rank) or events.names())


def assert_persistent_fallback(events: Events, iteration: int, path: str,
                               reason: str | None = None) -> None:
    """Host memory could not serve the recovery (the planner's reason starting with
    ``reason``, where given) and the ranks loaded ``iteration`` from the checkpoint in
    ``path`` instead."""
    if reason is not None:
        why = [e["reason"] for e in events.of("recovery_impossible")]
        assert any(w.startswith(reason) for w in why), (reason, why or events.names())
    loaded = events.of("recovered_persistent", iteration=iteration, path=path)
    assert loaded, events.of("recovered_persistent") or events.names()


def wait_watchers_exited(shm_dir: str, job: str, nodes, timeout: float = 90.0) -> None:
    """Until each of ``nodes``' watchers has exited (its flush done, or killed)."""
    from reft_ext.cluster import status, watcher

    deadline, pending = time.time() + timeout, set(nodes)
    while pending and time.time() < deadline:
        for n in list(pending):
            try:
                with open(status.watcher_pid_path(shm_dir, job, n)) as f:
                    pid = int(f.read())
            except (OSError, ValueError):
                continue
            if not watcher.alive(pid):
                pending.discard(n)
        time.sleep(0.2)
    assert not pending, f"watchers of nodes {sorted(pending)} still running"
