"""HealthConfig: the start-up health check and the elastic shrink, flags generated from
its fields with REFT's naming (``--reft-health-check``, ``--reft-min-nodes`` ...), the
same way as ReftConfig's (reft_ext/flags.py). See reft_ext/cluster/health.py and docs/nodes.md."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from reft_ext.config import ReftConfigError
from reft_ext.flags import ReftFlags

# the checks' names (here, not in health.py: parsing flags must not import torch)
MATMUL, ALLGATHER = "matmul", "all-gather"


@dataclass
class HealthConfig(ReftFlags):
    FLAG_TITLE = "REFT health check and elastic shrink"  # add_arguments, from_args

    health_check: str = field(default="auto", metadata=dict(
        help="auto | on | off: before resuming, every rank runs a matmul against a float64 "
             "reference and the nodes run all-gathers in pairs (a failed pair is regrouped "
             "to name the bad node). auto = on when --reft-snapshot-every > 0 or "
             "--reft-min-nodes is set"))
    health_timeout: int = field(default=60, metadata=dict(
        help="seconds a health-check collective may take before its pair counts as failed"))
    health_matmul_size: int = field(default=256, metadata=dict(
        help="N of the NxN matmul each rank checks (256: ~1 ms on a CPU core)"))
    min_nodes: int = field(default=0, metadata=dict(
        help="elastic launch (torchrun --nnodes MIN:MAX): the fewest nodes the job may "
             "shrink to when a node fails the health check; its agent then leaves and the "
             "others restart with fewer data-parallel replicas (default: REFT_MIN_NODES, "
             "set by tools/launch_nodes.py --min-nodes; 0 = not elastic: a failed node "
             "stops the job)"))
    inject_health_failure: str = field(default="", metadata=dict(
        help="NODE[:CHECK[:ATTEMPT]] (tests, demos): node NODE fails the health check "
             "(CHECK matmul, the default, or all-gather) on attempt ATTEMPT (default 0; "
             "the job's attempt: the highest torchrun restart count among its ranks)"))

    def __post_init__(self):
        if self.health_check not in ("auto", "on", "off"):
            raise ReftConfigError(f"--reft-health-check: unknown value {self.health_check!r};"
                                  f" choose from auto, on, off")
        if self.health_timeout < 1:
            raise ReftConfigError(f"--reft-health-timeout: must be >= 1 second, got "
                                  f"{self.health_timeout}")
        if self.health_matmul_size < 8:
            raise ReftConfigError(f"--reft-health-matmul-size: must be >= 8, got "
                                  f"{self.health_matmul_size}")
        if self.min_nodes == 0:
            env = os.environ.get("REFT_MIN_NODES", "0")
            if not env.isdigit():
                raise ReftConfigError(f"--reft-min-nodes: REFT_MIN_NODES={env!r} in the "
                                      f"environment is not a number")
            self.min_nodes = int(env)
        if self.min_nodes < 0:
            raise ReftConfigError(f"--reft-min-nodes: must be >= 0, got {self.min_nodes}")
        self.injection = self._parse_injection(self.inject_health_failure)

    @staticmethod
    def _parse_injection(text: str) -> tuple[int, str, int] | None:
        """'1' -> (1, 'matmul', 0); '2:all-gather:1' -> (2, 'all-gather', 1)."""
        if not text:
            return None
        parts = text.split(":")
        checks = {MATMUL: MATMUL, ALLGATHER: ALLGATHER, "allgather": ALLGATHER}
        ok = (1 <= len(parts) <= 3 and parts[0].isdigit() and
              (len(parts) < 2 or parts[1] in checks) and
              (len(parts) < 3 or parts[2].isdigit()))
        if not ok:
            raise ReftConfigError(f"--reft-inject-health-failure: expected "
                                  f"NODE[:matmul|all-gather[:ATTEMPT]], got {text!r}")
        return (int(parts[0]), checks[parts[1]] if len(parts) > 1 else MATMUL,
                int(parts[2]) if len(parts) > 2 else 0)

    def enabled(self, snapshot_every: int) -> bool:
        if self.health_check == "auto":
            return snapshot_every > 0 or self.min_nodes > 0
        return self.health_check == "on"
