"""pretrain_llama.py with every collective megatron-core calls staged through host copies
(megatron/training/gloo_device.py with a predicate that stages host tensors: what a run
of several ranks on one GPU does to device tensors, on a machine without one). Prints
``[STAGED] rank R name:count ...`` as it ends: the staging really ran, and on what.
Used by tests/integration/test_gloo_staging_ddp.py against the plain trainer."""

import os
import runpy
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.training import gloo_device  # noqa: E402


def _say(line: str) -> None:
    """One write of a whole line, on a line of its own: print() writes the text and its
    newline apart, and another rank's line landed between them (read as one line)."""
    sys.stdout.flush()
    os.write(1, f"\n{line}\n".encode())


def _report() -> None:
    counts = " ".join(f"{k}:{v}" for k, v in sorted(gloo_device.staged_calls.items()))
    _say(f"[STAGED] rank {os.environ.get('RANK', '0')} {counts or 'none'}")


if __name__ == "__main__":
    import megatron.core.tensor_parallel  # noqa: F401  (its aliases exist: swapped too)
    import megatron.core.distributed  # noqa: F401

    swapped = gloo_device.install(predicate=lambda t: isinstance(t, torch.Tensor))
    aliases = [s for s in swapped if "." in s]
    _say(f"[STAGED] rank {os.environ.get('RANK', '0')} aliases {' '.join(aliases)}")
    sys.argv = [os.path.join(REPO, "pretrain_llama.py"), *sys.argv[1:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        _report()
