"""The oracle that REFT does not share: every run whose state a test compares ends with a
persistent checkpoint (megatron-core's dist_checkpointing, its own sharded state dict),
and ``tools/compare_checkpoints.py`` compares two of them item by item; the losses of
every rank that computes them are compared iteration by iteration.

The ``[HASH]`` lines hash ``TrainingState.state_tensors()``, the very list REFT snapshots:
what that list missed, both would miss. The checkpoint does not go through that list.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

_root: str | None = None


def _session_dir() -> str:
    """One directory for the final checkpoints of this test session (reference runs are
    shared by the whole session), removed at exit."""
    global _root
    if _root is None:
        _root = tempfile.mkdtemp(prefix="reft-oracle-")
        atexit.register(shutil.rmtree, _root, True)
    return _root


def with_final_checkpoint(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` with a ``--save`` for the final checkpoint, and that root. Only runs that
    log their state hash (``--log-params-hash``: the runs tests compare) get one; a run
    that saves already keeps its own ``--save``."""
    if "--save" in args:
        return args, args[args.index("--save") + 1]
    if "--log-params-hash" not in args:
        return args, None
    root = tempfile.mkdtemp(dir=_session_dir(), prefix="ckpt-")
    return [*args, "--save", root], root


def assert_same_checkpoint(run, ref) -> None:
    """The final persistent checkpoints of both runs identical, item by item."""
    from tools.compare_checkpoints import compare_paths, table

    assert run.checkpoint and ref.checkpoint, (run.checkpoint, ref.checkpoint)
    rows, counts = compare_paths(run.checkpoint, ref.checkpoint)
    assert counts["tensors"] > 0, counts
    assert not rows, f"{run.checkpoint} vs {ref.checkpoint}:\n{table(rows)}"


def assert_same_losses(run, ref) -> None:
    """Every rank that logged losses in ``run`` logged them in ``ref`` too, and each of
    its iterations' loss is the same, bit for bit."""
    assert run.losses_by_rank, "no [LOSSES] record"
    assert set(run.losses_by_rank) == set(ref.losses_by_rank), \
        (sorted(run.losses_by_rank), sorted(ref.losses_by_rank))
    for rank, losses in run.losses_by_rank.items():
        want = ref.losses_by_rank[rank]
        bad = {i: (v, want.get(i)) for i, v in losses.items() if want.get(i) != v}
        assert not bad, f"rank {rank}: losses differ at {bad}"
