"""A worker process of the in-process supervisor: warm until it is given a rank.

    python -m reft_ext.cluster.spare --store HOST:PORT --id W --preload MOD[,MOD...] \\
        -- SCRIPT [ARGS...]

It imports ``--preload`` (torch, megatron-core, the trainer: the seconds a cold start
spends) and then blocks on ``reft/ip/assign/<W>`` in the supervisor's store. The
assignment is the environment of one rank (RANK, WORLD_SIZE, REFT_GENERATION, ...);
the worker adds it to its own and runs SCRIPT as ``__main__`` in this process, so a
replacement rank starts with every import done. The supervisor starts the job's first
ranks the same way (assigned at once), so there is one start-up path.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import time


def _die_with_parent() -> None:
    """A worker never outlives its supervisor (killed or crashed, it cannot clean up):
    the kernel SIGKILLs it when the supervisor dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the supervisor died before the prctl
            os._exit(1)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's close() is all there is


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the supervisor's store")
    p.add_argument("--id", required=True, help="this worker's id (its assignment key)")
    p.add_argument("--preload", default="", help="modules to import while waiting")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not rest:
        p.error("give the training script after '--'")
    _die_with_parent()
    t0 = time.time()
    for mod in filter(None, a.preload.split(",")):
        importlib.import_module(mod)
    import datetime

    import torch

    host, port = a.store.rsplit(":", 1)
    store = torch.distributed.TCPStore(host, int(port), is_master=False,
                                       timeout=datetime.timedelta(days=7),
                                       wait_for_workers=False)
    store.set(f"reft/ip/warm/{a.id}", f"{time.time() - t0:.3f}")
    env = json.loads(store.get(f"reft/ip/assign/{a.id}").decode())
    if not env:  # the supervisor is done with this spare
        return 0
    os.environ.update(env)
    os.environ["REFT_WARM_START"] = f"{time.time():.6f}"  # when the rank's life began
    del store
    sys.argv = list(rest)
    try:
        runpy.run_path(rest[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
