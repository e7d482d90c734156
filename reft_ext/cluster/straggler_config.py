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
             "compute and optimizer times (one all-gather of 4 numbers per rank; 0 = off)"))
    straggler_threshold: float = field(default=1.5, metadata=dict(
        help="a rank whose compute time is more than this many times the job's median is "
             "slow"))
    straggler_window: int = field(default=3, metadata=dict(
        help="exchanges in a row a rank must be slow before it is named a straggler "
             "(persistently slow: --reft-straggler-interval x this many iterations)"))

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

    @property
    def enabled(self) -> bool:
        return self.straggler_interval > 0
