"""Bit-identical: a recovered run against the failure-free run of the same flags."""

from __future__ import annotations


def same_as_reference(run, ref, first_after: int, last: int = 6) -> None:
    """Every rank's whole state (hash) equal, the run's losses start at ``first_after``
    (the first iteration after the one it resumed) and end at ``last``, each equal."""
    assert run.hashes == ref.hashes
    assert sorted(run.losses)[0] == first_after and max(run.losses) == last
    assert all(run.losses[i] == ref.losses[i] for i in run.losses)
