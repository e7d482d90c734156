"""Block quantization for ZeRO++'s communication (qwZ weights, qgZ gradients): symmetric,
one fp32 scale per block of ``block`` elements, int8, or int4 packed two per byte.

    scale = absmax(block) / qmax          (qmax 127 for int8, 7 for int4)
    code  = clamp(round_half_even(x / scale), -qmax, qmax)
    x'    = code * scale

``absmax / qmax`` clips nothing (DeepSpeed's ``2^b / (2 absmax)`` clips the largest
element). A block of zeros has scale 0 and dequantizes to zeros. A block holding a NaN
or an Inf gets a NaN scale and dequantizes to NaN, every element of it: a non-finite
value is never turned into a finite one on the wire (the step's NaN check and REFT's
loss-spike rollback must still see it). Pure torch; bit-identical on every run.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def padded(n: int, block: int) -> int:
    return -(-n // block) * block


def code_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of codes for n elements (padded to whole blocks)."""
    return padded(n, block) * bits // 8


def quantize(x: torch.Tensor, bits: int = 8, block: int = 256) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """(codes, scales) of a 1-D tensor: codes int8 (bits 8) or uint8 with two int4 codes a
    byte (bits 4, low nibble first), scales fp32, one per block."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block % 2:
        raise ValueError(f"block must be even, got {block}")
    qmax = QMAX[bits]
    n = x.numel()
    v = torch.zeros(padded(n, block), dtype=torch.float32)
    v[:n] = x.reshape(-1)
    v = v.view(-1, block)
    absmax = v.abs().amax(dim=1)  # NaN or Inf anywhere in a block: non-finite here
    scales = torch.where(torch.isfinite(absmax), absmax / qmax,
                         torch.full_like(absmax, float("nan")))
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero (and NaN) blocks
    q = torch.round(v / safe[:, None])  # torch.round: half to even
    q = torch.nan_to_num(q, nan=0.0).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    if bits == 8:
        return q, scales
    u = (q & 0xF).to(torch.uint8).view(-1, 2)
    return (u[:, 0] | (u[:, 1] << 4)).contiguous(), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8,
               block: int = 256, out: torch.Tensor | None = None) -> torch.Tensor:
    """The n values (fp32, or written into ``out`` in its dtype) of (codes, scales)."""
    if bits == 8:
        q = codes.to(torch.float32)
    else:
        lo = (codes & 0xF).to(torch.int8)
        hi = (codes >> 4).to(torch.int8)
        both = torch.stack((lo, hi), dim=1).reshape(-1)
        q = torch.where(both > 7, both - 16, both).to(torch.float32)  # sign of 4 bits
    v = (q.view(-1, block) * scales[:, None]).reshape(-1)[:n]
    if out is None:
        return v
    out.copy_(v.view(out.shape))
    return out
