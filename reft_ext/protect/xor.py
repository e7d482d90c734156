"""XOR erasure code over raw bytes: k members -> 1 parity, any 1 member recoverable.

Works on bytes, not elements, so fp32 / bf16 / fp16 / int / bool tensors all go
through the same kernel: pass tensors of any dtype (contiguous), they are
viewed as uint8 without a copy (``as_bytes``, reft_ext/state/layout.py).  All members and the
output must have the same number of bytes; callers pad the last member of a
group (the snapshot layout does this).

    parity = xor_encode([m0, m1, m2, m3], out=parity_buf)
    m2 = xor_decode(parity, [m0, m1, m3], out=m2_buf)

CPU tensors use the native multi-threaded AVX2/AVX-512 kernel when
``reft_ext._C`` is loaded (GIL released), CUDA tensors the native CUDA kernel
when it was built (on the current stream of ``out``'s device); otherwise the
pure-torch reference (:func:`xor_encode_reference`), which gives identical bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reft_ext import _native
from reft_ext.state.layout import as_bytes


def _span(b: torch.Tensor) -> tuple[int, int]:
    return b.data_ptr(), b.data_ptr() + b.numel()


def _check(members: list[torch.Tensor], out: torch.Tensor) -> None:
    if not members:
        raise ValueError("xor needs at least one member")
    n = out.numel()
    o0, o1 = _span(out)
    for i, m in enumerate(members):
        if m.numel() != n:
            raise ValueError(f"member {i} has {m.numel()} bytes, output has {n}: lengths must match")
        if m.device != out.device:
            raise ValueError(f"member {i} is on {m.device}, output on {out.device}")
        s0, s1 = _span(m)
        # Exact aliasing (in-place accumulate) is fine; a shifted overlap would
        # read bytes the kernel has already overwritten.
        if n and s0 != o0 and s0 < o1 and o0 < s1:
            raise ValueError(f"member {i} partially overlaps the output")


def xor_encode_reference(srcs: Sequence[torch.Tensor], out: torch.Tensor, *,
                         accumulate: bool = False) -> torch.Tensor:
    """Pure-torch oracle: out = [out ^] srcs[0] ^ ... ^ srcs[k-1], as bytes."""
    ob = as_bytes(out)
    members = ([ob] if accumulate else []) + [as_bytes(s) for s in srcs]
    _check(members, ob)
    if ob.numel() == 0:
        return out
    later_alias = any(m.data_ptr() == ob.data_ptr() for m in members[1:])
    if later_alias:  # out is read after members[0] would overwrite it
        acc = members[0].clone()
        for m in members[1:]:
            acc.bitwise_xor_(m)
        ob.copy_(acc)
        return out
    if members[0].data_ptr() != ob.data_ptr():
        ob.copy_(members[0])
    for m in members[1:]:
        torch.bitwise_xor(ob, m, out=ob)
    return out


def xor_encode(srcs: Sequence[torch.Tensor], out: torch.Tensor, *, accumulate: bool = False,
               num_threads: int | None = None) -> torch.Tensor:
    """out = srcs[0] ^ ... ^ srcs[k-1] (or out ^= ... with accumulate=True).

    Returns ``out``.  ``num_threads`` (CPU only) defaults to every usable CPU.
    Blocking; for pieces that fit a pipeline bubble pass byte-range views, e.g.
    ``as_bytes(t)[a:b]`` of every member and of the parity.
    """
    ob = as_bytes(out)
    members = ([ob] if accumulate else []) + [as_bytes(s) for s in srcs]
    _check(members, ob)
    n = ob.numel()
    if n == 0:
        return out
    C = _native.C
    if C is not None and ob.device.type == "cpu":
        C.xor_encode([m.data_ptr() for m in members], ob.data_ptr(), n,
                     num_threads=num_threads or 0)
        return out
    if C is not None and _native.HAVE_NATIVE_CUDA and ob.device.type == "cuda":
        stream = torch.cuda.current_stream(ob.device).cuda_stream
        with torch.cuda.device(ob.device):
            C.cuda_xor_encode([m.data_ptr() for m in members], ob.data_ptr(), n, stream=stream)
        return out
    return xor_encode_reference(srcs, out, accumulate=accumulate)


def xor_decode(parity: torch.Tensor, survivors: Sequence[torch.Tensor], out: torch.Tensor, *,
               num_threads: int | None = None) -> torch.Tensor:
    """Rebuilds the one missing member: out = parity ^ (XOR of the k-1 survivors)."""
    return xor_encode([parity, *survivors], out, num_threads=num_threads)

