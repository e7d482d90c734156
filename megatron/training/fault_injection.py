"""The trainer's one seam to fault injection (``--inject-fault``: tests, demos and
tools/chaos.py). The grammar and the observer that fires the faults are test machinery,
reft_ext/testing/fault_specs.py and fault_observer.py; the trainer only installs this
rank's observer from its flags. A plain run installs nothing, and every
``reft_ext.testing.fault_point`` in the code costs one ``None`` test."""

from __future__ import annotations

from reft_ext.testing.fault_observer import install
from reft_ext.testing.fault_specs import FaultSpec, parse_fault_specs

__all__ = ["install", "install_from_args"]  # install: the observer for specs at hand


def install_from_args(args, rank: int) -> list[FaultSpec]:
    """Parse ``--inject-fault`` (argument_validation.py validated it) and put this rank's observer
    behind fault_point when the flag names the rank; returns the specs, empty without the
    flag (REFT's session hands the REFT damage of their modes to the observer)."""
    specs = parse_fault_specs(args.inject_fault) if args.inject_fault else []
    install(specs, rank)
    return specs
