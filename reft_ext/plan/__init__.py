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

_EXPORTS = {
    "plan": "cli", "main": "cli", "PlanReport": "cli",
    "Plan": "planner", "SnapshotConfig": "planner",
    "ModelConfig": "model", "ParallelConfig": "model",
    "HardwareConfig": "hardware", "PROFILES": "hardware",
    "ReliabilityConfig": "reliability", "JobReliability": "reliability",
    "CostConfig": "hardware", "training_days": "hardware",
    "PlanConfigError": "common", "MODEL_PRESETS": "presets",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"reft_ext.plan.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'reft_ext.plan' has no attribute {name!r}")
