"""Protection schemes for the replicated slices of a sharding group (no communication
at save time: each member encodes from its own full copy of the replicated state).

A scheme has three verbs:

* ``encode(layout, out, lo)``: fill bytes [lo, lo + len(out)) of this member's redundancy
  block (any range, so the HAS scheduler can encode chunk by chunk, in bubbles);
* ``plan(own_ok, red_ok)``: given which members still hold a valid own slice and a valid
  redundancy block, say how each slice is rebuilt (``None``: the group cannot recover);
* ``recover(lost, slices, redundancy, out)``: rebuild slice ``lost``.

ARC: member d keeps a replica of slice (d+1) mod D; host bytes 2|P|/D.
AEC: each slice is cut into D-1 sub-blocks; sub-block k of slice j is XORed into the
parity of the k-th member other than j. Member m's parity is the XOR of one sub-block of
every other slice; host bytes |P|/D + |P|/(D(D-1)) = |P|/(D-1). Any one lost slice comes
back from the D-1 parities of the others and their slices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from reft_ext.state.layout import StateLayout
from reft_ext.state.regions import Region, Source
from reft_ext.protect.xor import xor_encode

# the plan's sources by their older names (Source.OWN == "own": plans compare as before)
OWN, REPLICA, PARITY = Source.OWN, Source.REPLICA, Source.PARITY

PROTECTIONS: dict[str, type[Protection]] = {}  # --reft-protect name -> scheme


def register(cls: type[Protection]) -> type[Protection]:
    """Class decorator: the scheme becomes available to :func:`make_protection` by its
    ``name`` (what manifests store and ``--reft-protect`` accepts)."""
    PROTECTIONS[cls.name] = cls
    return cls


class Protection(ABC):
    name = "abstract"

    def __init__(self, group_size: int):
        self.D = group_size

    def sub_blocks(self) -> int:
        """Slices must split into this many equal, aligned sub-blocks."""
        return 1

    @abstractmethod
    def redundancy_bytes(self, layout: StateLayout) -> int: ...

    @abstractmethod
    def encode(self, layout: StateLayout, out: torch.Tensor, lo: int = 0) -> None: ...

    @abstractmethod
    def sources(self, lost: int) -> list[int]:
        """Members whose redundancy block is needed to rebuild slice ``lost``."""

    def plan(self, own_ok: list[bool], red_ok: list[bool]) -> dict[int, Source] | None:
        """slice -> how it comes back (own / replica / parity), or None."""
        out = {}
        for d in range(self.D):
            if own_ok[d]:
                out[d] = Source.OWN
                continue
            how = self._rebuild_method(d, own_ok, red_ok)
            if how is None:
                return None
            out[d] = how
        return out

    def _rebuild_method(self, d, own_ok, red_ok):
        return None

    def recover(self, lost: int, slices: dict[int, torch.Tensor],
                redundancy: dict[int, torch.Tensor], out: torch.Tensor) -> None:
        raise RuntimeError(f"{self.name}: slice {lost} cannot be rebuilt")


@register
class NoProtection(Protection):
    name = "none"

    def redundancy_bytes(self, layout):
        return 0

    def encode(self, layout, out, lo=0):
        pass

    def sources(self, lost):
        return []


@register
class ARC(Protection):
    """Asynchronous redundant copying: a replica of the next member's slice."""

    name = "arc"

    def holder(self, lost: int) -> int:
        return (lost - 1) % self.D

    def redundancy_bytes(self, layout):
        return layout.slice_bytes

    def encode(self, layout, out, lo=0):
        start = layout.slice_range((layout.member + 1) % self.D)[0] + lo
        layout.replicated.read(start, start + out.numel(), out)

    def sources(self, lost):
        return [self.holder(lost)]

    def _rebuild_method(self, d, own_ok, red_ok):
        return Source.REPLICA if red_ok[self.holder(d)] else None

    def recover(self, lost, slices, redundancy, out):
        out.copy_(redundancy[self.holder(lost)])


@register
class AEC(Protection):
    """Asynchronous erasure coding: XOR parity spread over the other members."""

    name = "aec"

    def sub_blocks(self):
        return self.D - 1

    def _k(self, j: int, m: int) -> int:
        """Which sub-block of slice j goes into member m's parity (m != j)."""
        return m if m < j else m - 1

    def _member(self, j: int, k: int) -> int:
        """The member whose parity holds sub-block k of slice j."""
        return k if k < j else k + 1

    def redundancy_bytes(self, layout):
        return layout.slice_bytes // (self.D - 1)

    def encode(self, layout, out, lo=0):
        m, S, n = layout.member, self.redundancy_bytes(layout), out.numel()
        tmp = torch.empty(n, dtype=torch.uint8)
        first = True
        for j in range(self.D):
            if j == m:
                continue
            start = layout.slice_range(j)[0] + self._k(j, m) * S + lo
            if first:
                layout.replicated.read(start, start + n, out)
                first = False
            else:
                layout.replicated.read(start, start + n, tmp)
                xor_encode([tmp], out, accumulate=True)

    def sources(self, lost):
        return [m for m in range(self.D) if m != lost]

    def _rebuild_method(self, d, own_ok, red_ok):
        others = [j for j in range(self.D) if j != d]
        if all(own_ok[j] and red_ok[j] for j in others):
            return Source.PARITY
        return None

    def plan(self, own_ok, red_ok):
        if sum(not ok for ok in own_ok) > 1:
            return None  # one parity equation per sub-block: one unknown at most
        return super().plan(own_ok, red_ok)

    def recover(self, lost, slices, redundancy, out):
        S = out.numel() // (self.D - 1)
        for k in range(self.D - 1):
            m = self._member(lost, k)
            srcs = [redundancy[m]]
            for j in range(self.D):
                if j not in (m, lost):
                    kk = self._k(j, m)
                    srcs.append(slices[j][kk * S:(kk + 1) * S])
            xor_encode(srcs, out[k * S:(k + 1) * S])


def snapshot_regions(layout: StateLayout, protection: Protection,
                     aor_bytes: int = 0) -> dict[Region, list[int]]:
    """[offset, length] of each region of a rank's snapshot slot: its own slice, its
    redundancy block, its owned (ZeRO-1) state and, with AOR, the host replica of a
    peer's owned state. Real snapshots and the planner size host memory with this one
    function."""
    own, red, owned = layout.slice_bytes, protection.redundancy_bytes(layout), \
        layout.owned.nbytes
    return {Region.OWN: [0, own], Region.REDUNDANCY: [own, red],
            Region.OWNED: [own + red, owned], Region.AOR: [own + red + owned, aor_bytes]}


def make_protection(name: str, group_size: int) -> Protection:
    """The registered scheme ``name`` (none, arc, aec) for a group of ``group_size``."""
    return PROTECTIONS[name](group_size)
