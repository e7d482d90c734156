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


def _error(msg: str) -> None:
    """One line on stderr in one write: the ranks of a node share it, and print's
    separate write of the newline let two ranks' lines run into one."""
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()


def main(argv=None):
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        _error(str(exc))
        return 2
    from megatron.training.checkpointing import CheckpointError
    from megatron.training.training import pretrain
    from reft_ext.config import ReftConfigError
    from reft_ext.load.rollback import RollbackError
    from reft_ext.store.shm import ShmDirError, ShmSpaceError

    try:
        pretrain(args)
    except (ReftConfigError, ShmSpaceError, ShmDirError, RollbackError) as exc:
        _error(str(exc))
        return 2
    except CheckpointError as exc:
        _error(str(exc))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
