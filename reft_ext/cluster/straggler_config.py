"""StragglerConfig: run-time straggler detection, flags generated from its fields with
REFT's naming (``--reft-straggler-interval`` ...; reft_ext/flags.py), as HealthConfig's.
See reft_ext/cluster/stragglers.py and docs/operations.md "Slow nodes". Plain Python:
flags are parsed before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from reft_ext.config import ReftConfigError
from reft_ext.flags import ReftFlags


@dataclass
class StragglerConfig(ReftFlags):
    FLAG_TITLE = "REFT straggler detection"  # add_arguments, from_args

    straggler_interval: int = field(default=5, metadata=dict(
        help="every N iterations the ranks exchange the medians of their forward-backward "
             "compute and optimizer times (one all-gather of 6 numbers per rank over its "
             "data-parallel group, not waited for; 0 = off)"))
    straggler_threshold: float = field(default=1.5, metadata=dict(
        help="a rank whose compute time is more than this many times the job's median is "
             "slow"))
    straggler_window: int = field(default=3, metadata=dict(
        help="exchanges in a row a rank must be slow before it is named a straggler "
             "(persistently slow: --reft-straggler-interval x this many iterations)"))
    replace_stragglers: bool = field(default=False, metadata=dict(
        help="swap a node named a straggler for a warm spare of the in-process launcher "
             "(tools/launch_nodes.py --restart in-process --spares N), as a planned "
             "in-process restart right after a committed snapshot: no iteration lost. "
             "Needs --reft-restart in-process and --reft-protect arc or aec (the node's "
             "snapshot is never the last copy); one node at a time, at most as many as "
             "there are spares"))

    def __post_init__(self):
        if self.straggler_interval < 0:
            raise ReftConfigError(f"--reft-straggler-interval: must be >= 0 (0 = off), got "
                                  f"{self.straggler_interval}")
        if not self.straggler_threshold > 1.0:
            raise ReftConfigError(f"--reft-straggler-threshold: must be > 1 (a ratio to the "
                                  f"median), got {self.straggler_threshold}")
        if self.straggler_window < 1:
            raise ReftConfigError(f"--reft-straggler-window: must be >= 1, got "
                                  f"{self.straggler_window}")
        if self.replace_stragglers and not self.enabled:
            raise ReftConfigError("--reft-replace-stragglers: needs straggler detection "
                                  "(--reft-straggler-interval > 0)")

    def swap_problem(self, reft_cfg, in_process: bool, supervised: bool) -> str | None:
        """Why --reft-replace-stragglers cannot act in this job (None: it can)."""
        if not self.replace_stragglers:
            return None
        if not in_process:
            return ("a swap is an in-process restart: add --reft-restart in-process and "
                    "launch with tools/launch_nodes.py --restart in-process --spares N")
        if not supervised:
            return ("not started by the in-process supervisor (tools/launch_nodes.py "
                    "--restart in-process --spares N), which holds the spares")
        if not reft_cfg.enabled or reft_cfg.redundancy == "none":
            return ("the node that leaves must not hold the last copy of its state: add "
                    "--reft-snapshot-every N and --reft-protect arc (or aec)")
        return None

    @property
    def enabled(self) -> bool:
        return self.straggler_interval > 0
