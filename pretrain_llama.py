"""Pretrain a Llama model with megatron-core (CPU/gloo or GPU/NCCL).

    torchrun --nproc-per-node 4 pretrain_llama.py --model-size tiny \
        --pipeline-model-parallel-size 2 --use-distributed-optimizer --mock-data ...
"""

import os
import sys

# torch's CPU allocator backs tensors of 2 MiB and more with transparent huge pages
# (madvise): first touches fault 2 MiB at a time (a rejoin's received state, every
# iteration's activations), and a dead rank's address space is torn down in ms rather
# than the 0.1-0.2 s per GB that delays its peers' "connection closed" (docs/nodes.md).
# Read at torch's first allocation: set before it is imported; THP_MEM_ALLOC_ENABLE=0
# keeps 4 KiB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from megatron.training.arguments import ArgumentError, parse_args
from reft_ext.cluster.job_stop import (EXIT_CHECKPOINT, EXIT_WILL_REPEAT, say_once,
                                       stopped_by_peer)


def _parse(argv):
    """The flags; a usage error (argparse's) is one line, not its usage block: the
    caller says it once for the job."""
    import contextlib
    import io

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        lines = [ln for ln in captured.getvalue().splitlines() if ln.strip()]
        why = lines[-1].split(" error: ", 1)[-1] if lines else f"exit {exc.code}"
        raise ArgumentError(f"{why} (python pretrain_llama.py --help lists the flags)") \
            from None


def main(argv=None):
    from megatron.training.children import die_with_launcher

    die_with_launcher()  # no orphan training beside a re-run after the launcher's SIGKILL
    try:
        args = _parse(argv)
    except ArgumentError as exc:
        say_once(str(exc))
        return EXIT_WILL_REPEAT
    from megatron.training.checkpointing import CheckpointError
    from megatron.training.training import pretrain
    from reft_ext.config import ReftConfigError
    from reft_ext.load.rollback import RollbackError
    from reft_ext.store.shm import ShmDirError, ShmSpaceError

    try:
        pretrain(args)
    except (ReftConfigError, ShmSpaceError, ShmDirError, RollbackError) as exc:
        say_once(str(exc))  # the same at every restart: said once, not retried
        return EXIT_WILL_REPEAT
    except CheckpointError as exc:
        say_once(str(exc))
        return EXIT_CHECKPOINT
    except Exception:
        if stopped_by_peer():  # a peer said why the job stops; this is its echo
            return EXIT_WILL_REPEAT
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
