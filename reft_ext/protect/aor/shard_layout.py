"""What the two sides of an AOR pair agree on byte for byte: the shard's layout
(:class:`GroupSpec`, :class:`ShardSpec`: the replica buffer's regions, the step message's
header), the pair's checksums (xxh3 over host bytes, or :func:`wsum64` where the replay
is not bit-identical) and the flat host buffers both sides copy through.

Apart from the owner's side (``owner.py``) and the holder's (``replica.py``) so that the
two read one definition of every offset and checksum and neither imports the other.
Plain torch, like both of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reft_ext.state.layout import ALIGN, as_bytes
from reft_ext.store.checksum import FLAT, checksum_all

HEADER_MAGIC = 0x414F52  # "AOR"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class GroupSpec:
    """One param group: sizes and the static flags of its Adam call (foreach/fused
    resolved the way ``torch.optim.adam.adam`` resolves them on the owner)."""
    numels: tuple
    betas: tuple
    eps: float
    amsgrad: bool
    maximize: bool
    foreach: bool
    fused: bool
    capturable: bool
    differentiable: bool
    decoupled_weight_decay: bool


@dataclass(frozen=True)
class ShardSpec:
    """What a holder must know about the owner's shard: its groups, plus the torch build
    and intra-op thread count (CPU kernels split work by thread count)."""
    groups: tuple
    torch_version: str
    num_threads: int
    device: str = "cpu"  # where the owner's Adam runs: only "cpu" is replayed bit for bit
    kind: str = "adam"   # the owner's optimizer (AOR_KINDS): only torch's is replayed so

    @property
    def bit_identical(self) -> bool:
        """Does the holder's CPU replay reproduce the owner's update bit for bit?"""
        return self.device == "cpu" and self.kind == "adam"

    def checksum(self, pieces) -> int:
        """The pair's checksum of ``pieces`` (owner's state or replica, same byte order):
        xxh3 over host bytes where the replay is bit-identical (verified rarely, cheap on
        a CPU owner), else :func:`wsum64`, which the owner computes where its state is
        (on the device: no copy down, no hashing on the training thread)."""
        return _checksum(pieces) if self.bit_identical else wsum64(pieces)

    @property
    def numels(self) -> list:
        return [n for g in self.groups for n in g.numels]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def regions(self) -> dict:
        """name -> (byte offset, number of elements) in the replica's buffer: all params,
        all exp_avg, all exp_avg_sq (fp32, flat in group/param order), then the steps."""
        out, off = {}, 0
        for name, n in (("param", self.numel), ("exp_avg", self.numel),
                        ("exp_avg_sq", self.numel), ("step", len(self.numels))):
            out[name] = (off, n)
            off = _align(off + 4 * n)
        return out

    @property
    def nbytes(self) -> int:
        off, n = self.regions()["step"]
        return _align(off + 4 * n)

    def padding(self) -> list:
        """(start, end) byte ranges between regions: zeroed, so equal states are equal
        buffers."""
        regs = list(self.regions().values())
        starts = [off for off, _ in regs[1:]] + [self.nbytes]
        return [(off + 4 * n, s) for (off, n), s in zip(regs, starts) if off + 4 * n < s]

    @property
    def header_len(self) -> int:
        """float64 header of a step message: magic, seq, owner step, lr and wd per group."""
        return 3 + 2 * len(self.groups)

    @property
    def message_nbytes(self) -> int:
        return 8 * self.header_len + 4 * self.numel


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (a device tensor is copied: checksums read host bytes only)."""
    t = t.detach()
    return t.to("cpu") if t.device.type != "cpu" else t


def _checksum(pieces) -> int:
    """xxh3-64 (crc32 without xxhash) of the concatenated bytes of the tensors, taken in
    host memory: owner and holder compare these, so both sides use this one function."""
    return checksum_all([as_bytes(_host(t).contiguous()) for t in pieces], FLAT)


WSUM_CHUNK = 1 << 20  # int32 words per weight ramp (4 MiB of state)
_MASK64 = (1 << 64) - 1
_ramps: dict = {}  # device -> the cached ramp 1..WSUM_CHUNK (int64)


def wsum64(pieces) -> int:
    """A 64-bit checksum of the concatenated 4-byte words of ``pieces`` that gives the
    same value wherever the tensors live (CUDA, ROCm or CPU: integer sums only, exact
    and independent of the reduction order): s1 = sum of the words, s2 = sum over 4 MiB
    chunks c of (2c+1) x sum of word x its position in the chunk (1..2^20), both mod
    2^64 (two's complement wrap-around). Any one changed word changes s1; moved words
    change s2. A piece is a head up to its first chunk boundary, whole chunks taken as
    a (rows, chunk) view in blocks of WSUM_BLOCK rows (six kernels a block: 32 MiB of
    state, a 64 MiB temporary), and a tail; s1 in one kernel a piece; one sync at the
    end. :func:`wsum64_reference` is the chunk-by-chunk definition (its parity test)."""
    acc, pos = {}, 0
    for t in pieces:
        words = _words(t)
        if words is None:
            continue
        dev = words.device
        ramp = _ramp(dev)
        s1, s2 = _sums(acc, dev)
        s1 += words.sum(dtype=torch.int64)
        lo, n = 0, words.numel()
        while lo < n:
            c, at = divmod(pos, WSUM_CHUNK)
            if at or n - lo < WSUM_CHUNK:  # a head or a tail: part of one chunk
                k = min(n - lo, WSUM_CHUNK - at)
                s2 += (words[lo:lo + k].to(torch.int64) * ramp[at:at + k]).sum() * (2 * c + 1)
            else:  # whole chunks c .. c+rows-1: weights (2c+1), (2c+3), ...
                rows = min((n - lo) // WSUM_CHUNK, WSUM_BLOCK)
                k = rows * WSUM_CHUNK
                block = words[lo:lo + k].view(rows, WSUM_CHUNK).to(torch.int64)
                per_row = block.mul_(ramp).sum(dim=1)
                odd = torch.arange(2 * c + 1, 2 * (c + rows) + 1, 2, dtype=torch.int64,
                                   device=dev)
                s2 += per_row.mul_(odd).sum()
            lo, pos = lo + k, pos + k
    return _combine(acc, pos)


WSUM_BLOCK = 8  # whole chunks per kernel group of wsum64 (its int64 temporary: 8 x 8 MiB)


def _words(t):
    t = t.detach()
    if t.numel() == 0:
        return None
    if t.element_size() != 4 or not t.is_contiguous():
        raise ValueError(f"wsum64: 4-byte contiguous tensors only, got {t.dtype}")
    return t.view(-1).view(torch.int32)


def _sums(acc: dict, dev):
    """(s1, s2) of ``dev``: int64 zeros on it, made at its first piece."""
    if dev not in acc:
        acc[dev] = (torch.zeros((), dtype=torch.int64, device=dev),
                    torch.zeros((), dtype=torch.int64, device=dev))
    return acc[dev]


def _combine(acc: dict, pos: int) -> int:
    """The checksum from every device's (s1, s2) and the words' count (one sync each)."""
    t1 = t2 = 0
    for s1, s2 in acc.values():
        t1, t2 = t1 + int(s1), t2 + int(s2)
    return (t1 + 0x9E3779B97F4A7C15 * (t2 & _MASK64) + pos) & _MASK64


def _ramp(dev):
    if dev not in _ramps:
        _ramps[dev] = torch.arange(1, WSUM_CHUNK + 1, dtype=torch.int64, device=dev)
    return _ramps[dev]


def wsum64_reference(pieces) -> int:
    """:func:`wsum64` by its definition, 4 MiB chunk by chunk (the parity test's)."""
    acc, pos = {}, 0
    for t in pieces:
        words = _words(t)
        if words is None:
            continue
        dev = words.device
        s1, s2 = _sums(acc, dev)
        lo = 0
        while lo < words.numel():
            c, at = divmod(pos, WSUM_CHUNK)
            n = min(words.numel() - lo, WSUM_CHUNK - at)
            w = words[lo:lo + n].to(torch.int64)
            s1 += w.sum()
            s2 += (w * _ramp(dev)[at:at + n]).sum() * (2 * c + 1)
            lo, pos = lo + n, pos + n
    return _combine(acc, pos)


def copy_flat(src: list, out: torch.Tensor, non_blocking: bool = False) -> None:
    """``src`` end to end into ``out`` (the layout of ``torch.cat``), each tensor copied
    straight to its offset: no temporary the size of the whole (a device owner's fp32
    shard, at the step's memory peak). ``non_blocking``: device -> pinned host copies
    are only queued (on the current stream)."""
    off = 0
    for t in src:
        n = t.numel()
        out[off:off + n].copy_(t.reshape(-1), non_blocking=non_blocking)
        off += n
    if off != out.numel():
        raise ValueError(f"AOR: {off} elements into a buffer of {out.numel()}")


def _cat_into(src: list, out: torch.Tensor) -> None:
    """Flatten ``src`` end to end into ``out`` (host), from host or device tensors."""
    flat = [t.reshape(-1) for t in src]
    if flat[0].device == out.device:
        torch.cat(flat, out=out)
        return
    # device -> host tensor by tensor (no shard-sized device temporaries at start-up);
    # into pinned memory queued, then one wait for all of them
    pinned = out.is_pinned()
    copy_flat(flat, out, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(flat[0].device).synchronize()


def host_buffer(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """A uint8 host buffer; ``pinned`` (page-locked) where a device copies into it
    asynchronously (a pageable target makes a non_blocking copy synchronous)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _views(flat: torch.Tensor, numels) -> list:
    out, off = [], 0
    for n in numels:
        out.append(flat[off:off + n])
        off += n
    return out


def region(buffer: torch.Tensor, spec: ShardSpec, name: str) -> torch.Tensor:
    """The fp32 view of one region of a buffer laid out by ``spec``."""
    off, n = spec.regions()[name]
    return buffer[off:off + 4 * n].view(torch.float32)
