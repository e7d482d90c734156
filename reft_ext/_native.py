"""Loads the optional native engine ``reft_ext._C`` and says once when it is off.

Everything in reft_ext that has a native fast path asks this module for it:

* ``HAVE_NATIVE`` - the C++ copy engine / XOR kernels are usable;
* ``HAVE_NATIVE_CUDA`` - the extension was also built with its CUDA/ROCm part;
* ``C`` - the module itself (None when off);
* ``REASON`` - why it is off ('' when on).

``REFT_DISABLE_NATIVE=1`` in the environment forces the torch reference paths
(read once, at first import; tests start a subprocess with it to show both
paths give identical bytes).  The reference paths are pure torch and are the
correctness oracle for the native ones.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger("reft")

C: ModuleType | None = None
REASON = ""


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("REFT_DISABLE_NATIVE", "").strip() not in ("", "0"):
        return None, "REFT_DISABLE_NATIVE is set"
    try:
        from reft_ext import _C  # noqa: PLC0415
    except ImportError as exc:
        return None, f"reft_ext._C not importable: {exc}"
    return _C, ""


C, REASON = _load()
HAVE_NATIVE: bool = C is not None
HAVE_NATIVE_CUDA: bool = bool(HAVE_NATIVE and getattr(C, "HAS_CUDA", False))

if not HAVE_NATIVE:
    # Module body runs once per process, so this is logged once.
    log.warning("[REFT] native engine off (%s): using torch reference paths", REASON)
else:
    log.debug("[REFT] native engine on: %s", C.BUILD_INFO)


def num_cpus() -> int:
    """CPUs this process may use (affinity aware); the default thread count."""
    if C is not None:
        return int(C.num_cpus())
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # non-Linux
        return max(1, os.cpu_count() or 1)


def info() -> dict:
    """What the engine is running with, for logs and the benchmark header."""
    if C is None:
        return {"native": False, "reason": REASON}
    return {
        "native": True,
        "cuda": HAVE_NATIVE_CUDA,
        "build": C.BUILD_INFO,
        "cpu": dict(C.cpu_features()),
        "cpus": num_cpus(),
    }
