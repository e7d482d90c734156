"""Cluster-scale planning for REFT: ``python -m reft_ext.plan --help``.

From Python::

    from reft_ext.plan import plan
    report = plan(["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8", ...])
    print(report.render()); report.to_dict()

or build the pieces directly: :class:`~reft_ext.plan.planner.Plan` (snapshot sizes,
timing, host memory), :class:`~reft_ext.plan.reliability.JobReliability`,
:func:`~reft_ext.plan.hardware.training_days`. See docs/planner.md.

Imports are lazy: the trainer imports :mod:`reft_ext.plan.presets` at start-up.
"""

from __future__ import annotations

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "cli": ("plan", "main", "PlanReport"),
    "planner": ("Plan", "SnapshotConfig"),
    "model": ("ModelConfig", "ParallelConfig"),
    "hardware": ("HardwareConfig", "PROFILES", "CostConfig", "training_days"),
    "reliability": ("ReliabilityConfig", "JobReliability"),
    "common": ("PlanConfigError",),
    "presets": ("MODEL_PRESETS",),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
