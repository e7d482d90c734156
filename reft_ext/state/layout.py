"""How a rank's training state maps onto snapshot bytes.

The state of a rank has two parts:

* replicated: identical on the D members of its sharding group (same pipeline stage and
  TP rank, different DP rank): model parameters, and the optimizer state unless the
  optimizer is distributed. Flattened (tensor after tensor, as raw bytes) into one
  stream, padded to a multiple of ``D * align``, and cut into D equal slices; member d
  owns slice d.
* owned: only this rank has it (ZeRO-1 optimizer shards); saved whole by its owner.

The same code sizes real snapshots and the planner's estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reft_ext.store.checksum import Checksum

# bytes: slices, sub-blocks, the tier boundary and the AOR replica's regions start on
# cache lines (the copy and XOR kernels' non-temporal stores want aligned destinations)
ALIGN = 64


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor of any dtype and device (never copies:
    writes through the view reach the tensor; autograd does not see them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous to be viewed as bytes (call .contiguous())")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


@dataclass(frozen=True)
class Piece:
    """Bytes [src_off, src_off+n) of tensor ``index`` sit at ``dst_off`` in a range."""

    index: int
    src_off: int
    dst_off: int
    n: int


class StreamLayout:
    """A list of tensors seen as one byte stream."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self.names = [n for n, _ in tensors]
        self.tensors = [as_bytes(t) for _, t in tensors]
        self.offsets, off = [], 0
        for t in self.tensors:
            self.offsets.append(off)
            off += t.numel()
        self.nbytes = off
        self.on_device = any(t.device.type != "cpu" for t in self.tensors)
        # REFT-save of device tensors (reft_ext/copy/staging.py DeviceToHost, set by the
        # snapshotter): host reads go D2H through pinned staging on a side stream, not a
        # pageable copy_ on the training stream
        self.device_reader = None

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The tensor pieces covering stream bytes [start, end) (padding has none)."""
        out = []
        for i, (t, off) in enumerate(zip(self.tensors, self.offsets)):
            lo, hi = max(start, off), min(end, off + t.numel())
            if lo < hi:
                out.append(Piece(i, lo - off, lo - start, hi - lo))
        return out

    def read(self, start: int, end: int, out: torch.Tensor) -> None:
        """Copy stream bytes [start, end) into ``out`` (uint8), zero-filling padding."""
        if self.device_reader is not None and self.on_device and out.device.type == "cpu":
            self.device_reader.read(self, start, end, out)
            return
        covered = 0
        for p in self.pieces(start, end):
            out[p.dst_off:p.dst_off + p.n].copy_(self.tensors[p.index][p.src_off:p.src_off + p.n])
            covered += p.n
        if covered < end - start:
            out[covered:end - start].zero_()  # only the stream's tail is padding

    @torch.no_grad()
    def write(self, start: int, src: torch.Tensor) -> None:
        """Copy ``src`` (uint8) into stream bytes [start, start+len(src)). A device
        tensor gets a blocking H2D ``copy_`` (complete on return): host bytes never go
        through a device pointer."""
        for p in self.pieces(start, start + src.numel()):
            self.tensors[p.index][p.src_off:p.src_off + p.n].copy_(src[p.dst_off:p.dst_off + p.n])

    def checksum(self, start: int, end: int) -> int:
        """Checksum of stream bytes [start, end), padding as zeros, from the source tensors
        (a device piece is copied to the host first, explicitly: a blocking D2H)."""
        h, covered = Checksum(), 0
        for p in self.pieces(start, end):
            piece = self.tensors[p.index][p.src_off:p.src_off + p.n]
            h.update(piece if piece.device.type == "cpu" else piece.cpu())
            covered += p.n
        if covered < end - start:
            h.update(bytes(end - start - covered))
        return h.value


class StateLayout:
    """Replicated stream cut into D slices + owned stream, for member ``member``."""

    def __init__(self, replicated, owned, group_size: int, member: int, sub_blocks: int = 1):
        self.replicated = StreamLayout(replicated)
        self.owned = StreamLayout(owned)
        self.group_size, self.member = group_size, member
        quantum = ALIGN * group_size * max(1, sub_blocks)
        padded = -(-self.replicated.nbytes // quantum) * quantum
        self.padded = max(padded, quantum)
        self.slice_bytes = self.padded // group_size

    def slice_range(self, d: int) -> tuple[int, int]:
        return d * self.slice_bytes, (d + 1) * self.slice_bytes

    def signature(self) -> dict:
        """What must match for a snapshot to be loadable into this state."""
        return {"replicated": [list(self.replicated.names), self.replicated.nbytes],
                "owned": [list(self.owned.names), self.owned.nbytes],
                "group_size": self.group_size, "member": self.member,
                "slice_bytes": self.slice_bytes}
