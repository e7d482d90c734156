"""A snapshot's seal, and its job-wide commit's all-reduce, started by the snapshot thread
as soon as the last chunk is copied: in the bubbles, beside compute, not at the step.

Why (issue 57): with job-wide commits (--reft-keep 2) the training thread sealed the
manifest, then waited in an all-reduce over the job before its optimizer step: a second
job-wide synchronisation next to the step's own (the grad norm's), ~2% of `make run`'s
iteration as a user measures it (the same job with --reft-keep 3, local commits, was
that much faster). The agreement itself is unchanged: the pointer still moves on the
training thread, before the step, once every rank has sealed the iteration; only the
waiting for the slowest rank's seal happens while this rank still computes.

The all-reduce runs on a group of its own (:func:`commit_group`): posted from the
snapshot thread at a moment that differs between ranks, it must not share a group with
any collective the training thread issues (gloo pairs a group's collectives by their
order of issue). Every rank issues exactly one all-reduce on it per snapshot, in
snapshot order: early here, or on the training thread at the step when the thread did
not finish the snapshot (its drain did, or the schedule copies inline).
"""

from __future__ import annotations

import torch


def commit_group():
    """The job-wide group of the commit all-reduces (every rank, at the same point of its
    start, as every group)."""
    return torch.distributed.new_group(backend="gloo")


class EarlySeal:
    """The snapshot thread's ``on_done(batch)``: seals the batch's slot (its manifest
    written: complete on this rank) and, for job-wide commits, posts the agreement.
    :meth:`Committer.commit` waits for it on the training thread."""

    def __init__(self, committer):
        self.committer = committer

    def __call__(self, batch) -> None:
        try:
            batch.sums = self.committer.seal(batch.slot, batch.iteration, batch.digests,
                                             batch.meta)
        except Exception:  # noqa: BLE001 - sealed again at the step, where it raises
            batch.sums = None  # (a full /dev/shm: the training thread's own message)
            return
        if not self.committer.local:
            try:
                batch.agreement = torch.distributed.all_reduce(
                    torch.zeros(1, dtype=torch.int64), group=self.committer.group,
                    async_op=True)
            except Exception:  # noqa: BLE001 - a broken group: the step's sync one says so
                batch.agreement = None
