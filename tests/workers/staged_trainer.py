"""pretrain_llama.py with every collective megatron-core calls staged through host copies
(megatron/training/gloo_device.py with a predicate that stages host tensors: what a run
of several ranks on one GPU does to device tensors, on a machine without one). Prints
``[STAGED] rank R name:count ...`` at exit: the staging really ran, and on what.
Used by tests/integration/test_gloo_staging_ddp.py against the plain trainer."""

import atexit
import os
import runpy
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.training import gloo_device  # noqa: E402


def _report() -> None:
    counts = " ".join(f"{k}:{v}" for k, v in sorted(gloo_device.staged_calls.items()))
    print(f"[STAGED] rank {os.environ.get('RANK', '0')} {counts or 'none'}", flush=True)


if __name__ == "__main__":
    import megatron.core.tensor_parallel  # noqa: F401  (its aliases exist: swapped too)
    import megatron.core.distributed  # noqa: F401

    swapped = gloo_device.install(predicate=lambda t: isinstance(t, torch.Tensor))
    aliases = [s for s in swapped if "." in s]
    print(f"[STAGED] rank {os.environ.get('RANK', '0')} aliases {' '.join(aliases)}",
          flush=True)
    atexit.register(_report)
    sys.argv = [os.path.join(REPO, "pretrain_llama.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
