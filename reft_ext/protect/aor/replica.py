"""AOR (asynchronous optimizer recomputing): a host replica of a peer's ZeRO-1 shard.

With ``--use-distributed-optimizer`` the fp32 main params and Adam moments of a shard live
only on their owner. AOR keeps a copy on a host of another failure domain and advances it
every iteration with the same update, so that copy must stay *bit-identical*. Hence the
replica never re-derives Adam: it calls torch's own functional ``torch.optim.adam.adam``
with the flags and tensor order the owner's ``torch.optim.Adam/AdamW.step`` resolved,
on tensors of the same dtype and shapes, with the owner's exact inputs:

* the gradient the owner's torch optimizer sees: megatron's reduce-scattered fp32 shard
  *after* unscaling and gradient clipping (captured in a torch ``step`` pre-hook, so the
  clip coefficient, loss scale and grad norm are already folded in, bit for bit);
* per param group the ``lr`` and ``weight_decay`` the scheduler wrote into the group;
* the step count, which the replica keeps itself (checked against the owner's);
* skipped steps (found inf/nan) need nothing: megatron then never calls the torch step,
  on any rank (found_inf is all-reduced), so neither side moves.

An owner on a GPU (torch Adam/AdamW on CUDA tensors) ships the same inputs: its gradient
shard goes device -> pinned host on a side stream (:meth:`OwnerShard.capture` posts the
copy, :meth:`OwnerShard.wait_capture` waits on its event), and every checksum is taken
over host bytes. The CPU replay of a CUDA kernel is *not* bit-identical (other FMA and
vectorization choices): ``ShardSpec.device`` says so, the transport's verify compares
and re-syncs such a replica (docs/aor.md "Owners on a GPU").

This module is plain torch (no megatron, no torch.distributed): :class:`AORReplica`
lives in a caller-provided uint8 buffer (e.g. a /dev/shm segment) laid out by
:class:`ShardSpec`; the layout, the pair's checksums and host buffers are in
``reft_ext/protect/aor/shard_layout.py``, the owner's side (:class:`OwnerShard`, which
wraps the owner's torch optimizers) in ``reft_ext/protect/aor/owner.py``; their names are
importable from here too. The transport is ``reft_ext/protect/aor/transport.py``; the
design and traffic are in ``docs/aor.md``.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.adam import adam as torch_adam

# the pair's other names, importable from this module as before it was split (tests,
# workers, benchmarks import them from here)
from reft_ext.protect.aor.owner import OwnerShard, aor_kind  # noqa: F401
from reft_ext.protect.aor.shard_layout import (  # noqa: F401
    HEADER_MAGIC, WSUM_CHUNK, GroupSpec, ShardSpec, _cat_into, _checksum, _views, copy_flat,
    host_buffer, region, wsum64)


class AORReplica:
    """A peer's shard in ``buffer`` (uint8, ``spec.nbytes``; its bytes are the state, so
    snapshotting or restoring the replica is copying the buffer). ``lock`` is held while a
    step is applied: hold it to read a replica that may be advancing."""

    def __init__(self, spec: ShardSpec, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.numel() < spec.nbytes:
            raise ValueError(f"AOR replica needs a uint8 buffer of {spec.nbytes} bytes")
        self.spec, self.buffer = spec, buffer[:spec.nbytes]
        self.lock = threading.Lock()
        self.valid, self.reason = True, ""
        self.applied = 0  # step messages applied since (re)initialization
        self._flat = {k: region(self.buffer, spec, k) for k in spec.regions()}
        self._params, self._avgs, self._sqs, self._steps, off = [], [], [], [], 0
        for g in spec.groups:
            n = len(g.numels)
            for dst, key in ((self._params, "param"), (self._avgs, "exp_avg"),
                             (self._sqs, "exp_avg_sq")):
                whole = _views(self._flat[key], spec.numels)
                dst.append(whole[off:off + n])
            self._steps.append([self._flat["step"][i] for i in range(off, off + n)])
            off += n

    def state_tensors(self) -> list:
        """(name, tensor) views of the replica, in the byte order of :meth:`checksum`."""
        return [(f"aor.{k}", v) for k, v in self._flat.items()]

    def step_count(self) -> float:
        steps = self._flat["step"]
        return float(steps[0]) if steps.numel() else 0.0

    def checksum(self) -> int:
        with self.lock:
            return self.spec.checksum([v for _, v in self.state_tensors()])

    def invalidate(self, reason: str) -> None:
        """Never recover from this replica again (until it is re-initialized)."""
        self.valid, self.reason = False, reason

    @torch.no_grad()
    def apply(self, lrs, wds, grads: torch.Tensor) -> None:
        """One optimizer step with the owner's inputs: torch's functional Adam, group by
        group, same flags, same tensor order, exactly as ``Adam.step`` calls it."""
        if len(lrs) != len(self.spec.groups) or grads.numel() != self.spec.numel:
            raise ValueError("AOR: step message does not match the replica's layout")
        gviews = _views(grads, self.spec.numels)
        with self.lock:
            off = 0
            for gi, g in enumerate(self.spec.groups):
                n = len(g.numels)
                torch_adam(self._params[gi], gviews[off:off + n], self._avgs[gi],
                           self._sqs[gi], [], self._steps[gi], foreach=g.foreach,
                           capturable=g.capturable, differentiable=g.differentiable,
                           fused=g.fused, grad_scale=None, found_inf=None,
                           has_complex=False, decoupled_weight_decay=g.decoupled_weight_decay,
                           amsgrad=g.amsgrad, beta1=g.betas[0], beta2=g.betas[1],
                           lr=lrs[gi], weight_decay=wds[gi], eps=g.eps, maximize=g.maximize)
                off += n
            self.applied += 1

    def apply_message(self, message: torch.Tensor, expected_seq: int) -> None:
        """Parse a step message (see :meth:`OwnerShard.capture`) and apply it; a message
        out of sequence or from another step count invalidates the replica."""
        h = self.spec.header_len
        header = message[:8 * h].view(torch.float64).tolist()
        G = len(self.spec.groups)
        magic, seq, owner_step = header[:3]
        if magic != HEADER_MAGIC or int(seq) != expected_seq:
            self.invalidate(f"message {int(seq)} (magic {magic}) where {expected_seq} "
                            "was expected")
        elif owner_step != self.step_count():
            self.invalidate(f"owner is at Adam step {owner_step}, replica at "
                            f"{self.step_count()}")
        if not self.valid:
            return
        self.apply(header[3:3 + G], header[3 + G:3 + 2 * G],
                   message[8 * h:8 * h + 4 * self.spec.numel].view(torch.float32))
