"""Bit-identical: a recovered run against the failure-free run of the same flags, by
three independent witnesses: the [HASH] of REFT's list of state tensors, the final
persistent checkpoint compared item by item (tests/harness/oracle.py), and every loss
of every rank that computes one."""

from __future__ import annotations

from tests.harness.oracle import assert_same_checkpoint, assert_same_losses


def same_state(run, ref) -> None:
    """The whole final state equal, by hash and by checkpoint, and every loss ``run``
    logged equal to ``ref``'s of that iteration on that rank."""
    assert run.hashes == ref.hashes
    assert_same_losses(run, ref)
    assert_same_checkpoint(run, ref)


def same_as_reference(run, ref, first_after: int, last: int = 6) -> None:
    """:func:`same_state`, and the run's losses (every logging rank's) start at
    ``first_after`` (the first iteration after the one it resumed) and end at ``last``."""
    for rank, losses in run.losses_by_rank.items():
        assert min(losses) == first_after and max(losses) == last, (rank, sorted(losses))
    same_state(run, ref)
