"""Pretrain a Llama model with megatron-core (CPU/gloo or GPU/NCCL).

    torchrun --nproc-per-node 4 pretrain_llama.py --model-size tiny \
        --pipeline-model-parallel-size 2 --use-distributed-optimizer --mock-data ...
"""

import sys

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
