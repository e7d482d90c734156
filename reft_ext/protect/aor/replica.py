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

This module is plain torch (no megatron, no torch.distributed): :class:`OwnerShard` wraps
the owner's torch optimizers, :class:`AORReplica` lives in a caller-provided uint8 buffer
(e.g. a /dev/shm segment) laid out by :class:`ShardSpec`. The transport is
``reft_ext/protect/aor/transport.py``; the design and traffic are in ``docs/aor.md``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.optimizer import _default_to_fused_or_foreach

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

    @property
    def bit_identical(self) -> bool:
        """Does the holder's CPU replay reproduce the owner's update bit for bit?"""
        return self.device == "cpu"

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


def _cat_into(src: list, out: torch.Tensor) -> None:
    """Flatten ``src`` end to end into ``out`` (host), from host or device tensors."""
    flat = [t.reshape(-1) for t in src]
    if flat[0].device == out.device:
        torch.cat(flat, out=out)
    else:  # cat on the device, one copy down (torch.cat cannot write across devices)
        out.copy_(torch.cat(flat))


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


class OwnerShard:
    """The owner's side: its torch Adam/AdamW optimizers (inside megatron's
    DistributedOptimizer: ``opt.optimizer`` of each chained optimizer), in a fixed order."""

    def __init__(self, torch_optimizers):
        self.opts = [o for o in torch_optimizers if o is not None]
        for o in self.opts:
            if not isinstance(o, torch.optim.Adam):  # AdamW subclasses Adam in torch 2.x
                raise NotImplementedError(
                    f"AOR replays torch.optim.Adam/AdamW only, not {type(o).__name__} "
                    "(apex/TE fused kernels have no bit-identical CPU twin)")
        devices = {p.device for o in self.opts for g in o.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise NotImplementedError(f"AOR: the owner's main params live on several "
                                      f"devices {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._copy_stream = self._copied = None  # device owners: the D2H stream, event
        self.materialize()
        self.spec = self._spec()

    @property
    def on_device(self) -> bool:
        """The shard lives on an accelerator: grads go down through pinned memory."""
        return self.device.type != "cpu"

    def groups(self):
        for o in self.opts:
            yield from o.param_groups

    def params(self) -> list:
        return [p for g in self.groups() for p in g["params"]]

    def materialize(self) -> None:
        """Create missing Adam state exactly as torch's ``Adam._init_group`` would on the
        first step (zero moments, a float32 CPU step tensor), so it can be copied now."""
        for o in self.opts:
            for g in o.param_groups:
                if g["capturable"] or g["fused"]:
                    raise NotImplementedError("AOR: capturable/fused Adam keeps its step on "
                                              "the device; not supported")
                if g["amsgrad"]:
                    raise NotImplementedError("AOR: amsgrad is not supported")
                for p in g["params"]:
                    st = o.state[p]
                    if "step" not in st:
                        st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        if key not in st:
                            st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _spec(self) -> ShardSpec:
        groups = []
        for g in self.groups():
            params = g["params"]
            for p in params:
                if p.dtype != torch.float32 or p.is_complex() or not p.is_contiguous():
                    raise NotImplementedError(f"AOR: main params must be contiguous fp32, "
                                              f"got {p.dtype}")
            fused, foreach = g["fused"], g["foreach"]
            if fused is None and foreach is None:  # what torch.optim.adam.adam decides
                _, foreach = _default_to_fused_or_foreach(params, g["differentiable"], False)
            groups.append(GroupSpec(
                numels=tuple(p.numel() for p in params),
                betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                amsgrad=bool(g["amsgrad"]), maximize=bool(g["maximize"]),
                foreach=bool(foreach), fused=bool(fused), capturable=bool(g["capturable"]),
                differentiable=bool(g["differentiable"]),
                decoupled_weight_decay=bool(g.get("decoupled_weight_decay", False))))
        return ShardSpec(tuple(groups), torch.__version__, torch.get_num_threads(),
                         self.device.type)

    def _state(self, key: str) -> list:
        return [o.state[p][key] for o in self.opts for g in o.param_groups
                for p in g["params"]]

    def step_count(self) -> float:
        steps = {float(s) for s in self._state("step")}
        if len(steps) > 1:
            raise RuntimeError(f"AOR: owner's params disagree on the Adam step: {steps}")
        return steps.pop() if steps else 0.0

    def capture(self, header: torch.Tensor, grads: torch.Tensor, seq: int) -> None:
        """Fill a step message: call right before the torch step (step pre-hook), when the
        grads are reduced, unscaled and clipped and the groups carry this step's lr/wd.
        On a device the grads' copy is only posted (``grads`` must be pinned): call
        :meth:`wait_capture` before anything reads ``grads``."""
        lrs, wds = [], []
        for g in self.groups():
            if isinstance(g["lr"], torch.Tensor):
                raise NotImplementedError("AOR: tensor lr is not supported")
            lrs.append(float(g["lr"]))
            wds.append(float(g["weight_decay"]))
        header.copy_(torch.tensor([HEADER_MAGIC, seq, self.step_count(), *lrs, *wds],
                                  dtype=torch.float64))
        params = self.params()
        if any(p.grad is None for p in params):
            raise RuntimeError("AOR: a main param has no grad at the optimizer step")
        if params and self.on_device:
            self._copy_down([p.grad for p in params], grads)
        elif params:  # CPU: one memcpy, unchanged (the bit-identical path)
            torch.cat([p.grad.reshape(-1) for p in params], out=grads)

    def _copy_down(self, src: list, out: torch.Tensor) -> None:
        """Post flatten + device -> pinned host copy on a side stream, after the work
        the compute stream has queued (the reduce-scatter, unscale, clip of ``src``);
        an event marks its end. The optimizer's kernels run meanwhile (they only read
        the grads, which stay alive until :meth:`wait_capture`)."""
        if out.device.type != "cpu" or not out.is_pinned():
            raise ValueError("AOR: a device owner's step message needs a pinned host "
                             "buffer (host_buffer(n, pinned=True))")
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._copied = torch.cuda.Event()
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            flat = torch.cat([t.reshape(-1) for t in src])
            out.copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # freed by the allocator only after the copy
            self._copied.record(stream)

    def wait_capture(self) -> None:
        """Block until the posted gradient copy is in host memory (no-op on CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def pieces(self) -> list:
        """The owner's state in the replica's byte order (for checksums and packing)."""
        steps = torch.stack(self._state("step")).to(torch.float32) if self.params() else \
            torch.empty(0)
        return [*self.params(), *self._state("exp_avg"), *self._state("exp_avg_sq"), steps]

    def checksum(self) -> int:
        return _checksum(self.pieces())

    @torch.no_grad()
    def pack_state(self, out: torch.Tensor) -> None:
        """Write the whole shard state into ``out`` (uint8, ``spec.nbytes``)."""
        for lo, hi in self.spec.padding():
            out[lo:hi].zero_()
        for name, key in (("param", None), ("exp_avg", "exp_avg"),
                          ("exp_avg_sq", "exp_avg_sq")):
            src = self.params() if key is None else self._state(key)
            if src:
                _cat_into(src, region(out, self.spec, name))
        if self.params():
            region(out, self.spec, "step").copy_(torch.stack(self._state("step")))

    @torch.no_grad()
    def unpack_state(self, src: torch.Tensor) -> None:
        """Recovery: overwrite the shard state from a replica's bytes (uint8)."""
        numels = self.spec.numels
        for name, dst in (("param", self.params()), ("exp_avg", self._state("exp_avg")),
                          ("exp_avg_sq", self._state("exp_avg_sq"))):
            for d, s in zip(dst, _views(region(src, self.spec, name), numels)):
                d.view(-1).copy_(s)
        for d, s in zip(self._state("step"), region(src, self.spec, "step")):
            d.copy_(s)


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
            return _checksum([v for _, v in self.state_tensors()])

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
