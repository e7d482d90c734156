"""REFT extension library: snapshots, protection (ARC/AEC/AOR) and reload.

A library with small interfaces; it never imports ``megatron.training``. A trainer needs
two names: ``from reft_ext import ReftSession, ReftConfig`` (reft_ext/session.py,
reft_ext/config.py). They are imported on first use (PEP 562), so ``import reft_ext``
(the planner, the node watcher, the launcher's clean-up) does not pull in torch.
"""

__version__ = "0.1.0"

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "config": ("ReftConfig", "ReftConfigError"),
    "session": ("ReftSession", "DisabledSession"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
