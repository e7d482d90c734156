"""Protection schemes for the replicated slices of a sharding group (no communication
at save time: each member encodes from its own full copy of the replicated state).

A scheme has three verbs:

* ``encode(layout, out, lo)``: fill bytes [lo, lo + len(out)) of this member's redundancy
  block (any range, so the HAS scheduler can encode chunk by chunk, in bubbles);
* ``plan(own_ok, red_ok)``: given which members still hold a valid own slice and a valid
  redundancy block, say how each slice is rebuilt (``None``: the group cannot recover);
* ``recover(lost, slices, redundancy, out)``: rebuild slice ``lost``.

Where each member's redundancy lives is the group's placement
(reft_ext/protect/placement.py); below, "next" and "parity group" are its.
ARC: member d keeps a replica of the next member's slice; host bytes 2|P|/D.
AEC: within a parity group of G members, each slice is cut into G-1 sub-blocks;
sub-block k of slice j is XORed into the parity of the k-th member other than j. A
member's parity is the XOR of one sub-block of every other slice of its group; host
bytes |P|/D + |P|/(D(G-1)) (G = D with one member per node: |P|/(D-1)). Any one lost
slice per parity group comes back from the G-1 parities of the others and their slices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from reft_ext.state.layout import StateLayout
from reft_ext.state.regions import Region, Source
from reft_ext.protect.placement import Placement, place
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
    """A scheme over one sharding group, placed across failure domains (``placement``,
    reft_ext/protect/placement.py: who keeps whose redundancy)."""

    name = "abstract"

    def __init__(self, placement: Placement):
        self.placement = placement
        self.D = placement.D

    def sub_blocks(self) -> int:
        """Slices must split into this many equal, aligned sub-blocks."""
        return 1

    def replica_of(self, member: int) -> int | None:
        """The slice ``member``'s redundancy block is a plain copy of (ARC), else None."""
        return None

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
    """Asynchronous redundant copying: a replica of the slice of the member after this
    one on the placement's ring (on another failure domain)."""

    name = "arc"

    def holder(self, lost: int) -> int:
        return self.placement.holder(lost)

    def replica_of(self, member: int) -> int:
        return self.placement.protects(member)

    def redundancy_bytes(self, layout):
        return layout.slice_bytes

    def encode(self, layout, out, lo=0):
        start = layout.slice_range(self.replica_of(layout.member))[0] + lo
        layout.replicated.read(start, start + out.numel(), out)

    def sources(self, lost):
        return [self.holder(lost)]

    def _rebuild_method(self, d, own_ok, red_ok):
        return Source.REPLICA if red_ok[self.holder(d)] else None

    def recover(self, lost, slices, redundancy, out):
        out.copy_(redundancy[self.holder(lost)])


@register
class AEC(Protection):
    """Asynchronous erasure coding: XOR parity spread over the other members of a parity
    group (the whole sharding group with one member per failure domain; else one member
    per domain, reft_ext/protect/placement.py). Positions below are within the group."""

    name = "aec"

    def __init__(self, placement: Placement):
        super().__init__(placement)
        sizes = {len(g) for g in placement.parity_groups}
        if len(sizes) != 1 or min(sizes) < 2:
            raise ValueError(f"aec needs parity groups of one size >= 2, got "
                             f"{placement.parity_groups}")
        self.G = sizes.pop()

    def sub_blocks(self):
        return self.G - 1

    @staticmethod
    def _k(j: int, m: int) -> int:
        """Which sub-block of slice j goes into position m's parity (m != j)."""
        return m if m < j else m - 1

    @staticmethod
    def _member(j: int, k: int) -> int:
        """The position whose parity holds sub-block k of slice j."""
        return k if k < j else k + 1

    def redundancy_bytes(self, layout):
        return layout.slice_bytes // (self.G - 1)

    def encode(self, layout, out, lo=0):
        group = self.placement.parity_group(layout.member)
        m, S, n = group.index(layout.member), self.redundancy_bytes(layout), out.numel()
        reader = getattr(layout.replicated, "device_reader", None)
        if reader is not None and layout.replicated.on_device:
            # state on a GPU: XOR there (CUDA kernel), only the parity crosses to the host;
            # XOR is order-free, so the bytes are the loop's below
            starts = [layout.slice_range(member)[0] + self._k(j, m) * S + lo
                      for j, member in enumerate(group) if j != m]
            reader.xor_read(layout.replicated, starts, out)
            return
        tmp = torch.empty(n, dtype=torch.uint8)
        first = True
        for j, member in enumerate(group):
            if j == m:
                continue
            start = layout.slice_range(member)[0] + self._k(j, m) * S + lo
            if first:
                layout.replicated.read(start, start + n, out)
                first = False
            else:
                layout.replicated.read(start, start + n, tmp)
                xor_encode([tmp], out, accumulate=True)

    def sources(self, lost):
        return [m for m in self.placement.parity_group(lost) if m != lost]

    def _rebuild_method(self, d, own_ok, red_ok):
        if all(own_ok[j] and red_ok[j] for j in self.sources(d)):
            return Source.PARITY
        return None

    def plan(self, own_ok, red_ok):
        for g in self.placement.parity_groups:
            if sum(not own_ok[d] for d in g) > 1:
                return None  # one parity equation per sub-block: one unknown at most
        return super().plan(own_ok, red_ok)

    def recover(self, lost, slices, redundancy, out):
        group = self.placement.parity_group(lost)
        b, S = group.index(lost), out.numel() // (self.G - 1)
        for k in range(self.G - 1):
            a = self._member(b, k)
            srcs = [redundancy[group[a]]]
            for c, member in enumerate(group):
                if c not in (a, b):
                    kk = self._k(c, a)
                    srcs.append(slices[member][kk * S:(kk + 1) * S])
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


def make_protection(name: str, group: int | Placement) -> Protection:
    """The registered scheme ``name`` (none, arc, aec) over a sharding group: its
    placement, or its size for a group with one member per failure domain."""
    if isinstance(group, int):
        group = place(range(group))
    return PROTECTIONS[name](group)
