"""Recovery data received from a peer is checked before it is used.

During a restore a rank takes bytes from its group members: slices (an ARC replica or
the sender's own), parity blocks to decode a lost slice from, and the AOR replica of its
optimizer shard. The sender verified its region against its own manifest, but the bytes
then cross a process boundary and a network; a receiver that trusted them would write
whatever arrived into the model. So each one is checked against the checksum its writer
recorded at snapshot time, which reached every rank through the all-gathered inventories
(reft_ext/load/inventory.py ``Held.sums``): another path than the data's.

Not covered: a slice rebuilt for a member whose memory is gone (its own checksum went
with it; the parity blocks it is decoded from are checked, and decoding is exact), and
the metadata a rebuilding member takes from a peer's manifest (sealed by its own
checksum there, sent as a pickle between ranks of the job, which trust each other:
docs/security.md).

A failed check is agreed job-wide before anything is written into the model
(:meth:`Received.agree`): REFT-load then reports it and the caller falls back to the
persistent checkpoint, as for any host-memory state it cannot trust.
"""

from __future__ import annotations

import torch

from reft_ext.report.events import reft_print
from reft_ext.state.regions import Region
from reft_ext.store.checksum import checksum
from reft_ext.testing import fault_point

__all__ = ["Received", "outgoing"]


def outgoing(payload: torch.Tensor, iteration: int, what: str, to: int) -> torch.Tensor:
    """What a rank sends to a peer: ``payload`` itself. (Tests: an ``--inject-fault``
    ``corrupt-send`` returns a copy with one byte flipped, a corruption in transit.)"""
    alt = fault_point("load-send", iteration=iteration, payload=payload, what=what, to=to)
    return payload if alt is None else alt


class Received:
    """The checks of one rank's restore of iteration ``iteration``. ``inventories``:
    every rank's (all-gathered) ``{iteration: Held}``."""

    def __init__(self, rank: int, iteration: int, inventories: list[dict]):
        self.rank, self.iteration = rank, iteration
        self.inventories = inventories
        self.problems: list[str] = []
        self.checked = 0  # bytes checked against a checksum (what the checks cost)

    def expected(self, rank: int, region: Region | int) -> tuple[int, str] | None:
        """(checksum, algorithm) ``rank`` recorded for ``region`` of this iteration."""
        held = self.inventories[rank].get(self.iteration)  # a Held (an OldHeld: reshard)
        if held is None or region not in held.sums:
            return None
        return held.sums[region], held.algorithm

    def check(self, buf: torch.Tensor, what: str, src: int, owner: int,
              region: Region | int) -> bool:
        """``buf`` (received from rank ``src``) against the checksum rank ``owner``
        recorded for ``region`` (after a shrink: the old slice index, reshard.py); a
        mismatch is kept for :meth:`agree`. A missing checksum (an owner whose memory
        is gone) passes: nothing to check against."""
        want = self.expected(owner, region)
        if want is None:
            return True
        self.checked += buf.numel()
        got = checksum(buf, want[1])
        if got == want[0]:
            return True
        recorded = "its" if owner == src else f"rank {owner}'s"
        self.problems.append(f"{what} received from rank {src} does not match {recorded} "
                             f"{want[1]} checksum ({got:#x} != {want[0]:#x})")
        return False

    def agree(self, control_group) -> bool:
        """Collective, before anything received is written: True when every rank's
        checks passed. Each rank that found a mismatch says which."""
        for p in self.problems:
            reft_print(f"rank {self.rank}: recovery data of iteration {self.iteration}: {p}",
                       event="received_corrupt", rank=self.rank, iteration=self.iteration,
                       problem=p)
        bad = torch.tensor([len(self.problems)], dtype=torch.int64)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.SUM,
                                     group=control_group)
        return int(bad.item()) == 0
