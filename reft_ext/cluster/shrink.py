"""What REFT's host memory does when the start-up health check (health.py) fails a node
and the job shrinks or stops (docs/nodes.md). The trainer's call site
(megatron/training/reft_integration.py) decides who stays and who leaves; what that
means for the shared memory, and the note REFT-load reads after the restart
(reft_ext/load/reshard.py), is decided here, next to the library that reads them.
"""

from __future__ import annotations

import shutil

from reft_ext.cluster import status as node_status
from reft_ext.config import ReftConfig
from reft_ext.store.paths import node_dir


def mark_unhealthy(cfg: ReftConfig, node: int, ranks: list[int], why: str) -> None:
    """The node's own status file says it failed the check (call on one rank of the
    node: the file has one writer)."""
    node_status.write(cfg.shm_dir, cfg.job_id, node, node_status.UNHEALTHY, ranks=ranks,
                      detail=f"failed the health check ({why})")


def leave_job(cfg: ReftConfig, node: int) -> None:
    """A failed node leaves the job: its host memory goes with it (another node's ranks
    may take its index, and so its shared-memory directory, in the smaller job). Call
    on the node's first rank."""
    shutil.rmtree(node_dir(cfg.shm_dir, cfg.job_id, node), ignore_errors=True)


def hand_over(cfg: ReftConfig, rank: int, node: int, world_size: int) -> None:
    """A healthy rank stays for the smaller job: who it was in this one, for REFT-load
    after the restart (reft_ext/load/reshard.py reads and removes the note). Nothing
    when snapshots are off (nothing in memory to reshard)."""
    if not cfg.enabled:
        return
    from reft_ext.load.reshard import write_handover

    write_handover(cfg.shm_dir, cfg.job_id, rank, node, world_size)
