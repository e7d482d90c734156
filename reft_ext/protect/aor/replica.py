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
    change s2. Reads each word a few times on its own device, one sync at the end."""
    acc, pos = {}, 0
    for t in pieces:
        t = t.detach()
        if t.numel() == 0:
            continue
        if t.element_size() != 4 or not t.is_contiguous():
            raise ValueError(f"wsum64: 4-byte contiguous tensors only, got {t.dtype}")
        words, dev = t.view(-1).view(torch.int32), t.device
        if dev not in _ramps:
            _ramps[dev] = torch.arange(1, WSUM_CHUNK + 1, dtype=torch.int64, device=dev)
        s1, s2 = acc.setdefault(dev, (torch.zeros((), dtype=torch.int64, device=dev),
                                      torch.zeros((), dtype=torch.int64, device=dev)))
        lo = 0
        while lo < words.numel():
            c, at = divmod(pos, WSUM_CHUNK)
            n = min(words.numel() - lo, WSUM_CHUNK - at)
            w = words[lo:lo + n].to(torch.int64)
            s1 += w.sum()
            s2 += (w * _ramps[dev][at:at + n]).sum() * (2 * c + 1)
            lo, pos = lo + n, pos + n
    t1 = t2 = 0
    for s1, s2 in acc.values():
        t1, t2 = t1 + int(s1), t2 + int(s2)
    return (t1 + 0x9E3779B97F4A7C15 * (t2 & _MASK64) + pos) & _MASK64


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


def aor_kind(opt) -> str | None:
    """The optimizer kinds AOR protects (the AOR column of megatron/training/
    optimizer_state.py's table): "adam" for torch's Adam/AdamW (replayed bit for bit on
    a CPU owner), "fused_adam" for apex's and TransformerEngine's FusedAdam (the same
    update, moments in ``state``, the step count in each param group, AdamW unless
    ``adam_w_mode`` is off; replayed with torch's Adam, so exact only where verified and
    re-synced). None: not protected."""
    if isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam in torch 2.x
        return "adam"
    cls = type(opt)
    if cls.__name__ == "FusedAdam" and cls.__module__.split(".")[0] in (
            "apex", "transformer_engine"):
        return "fused_adam"
    return None


def _fused_refusal(opt) -> str | None:
    """What of a FusedAdam the replay cannot follow (apex/TE keep these on the optimizer,
    not in the param groups)."""
    if getattr(opt, "capturable", False):
        return "capturable=True (its step and lr live on the device)"
    if getattr(opt, "master_weights", False) or getattr(opt, "use_master", False) or \
            getattr(opt, "store_param_remainders", False):
        return "master weights kept inside the optimizer"
    for attr in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(opt, attr, torch.float32) != torch.float32:
            return f"{attr}={getattr(opt, attr)}"
    if any(not g.get("bias_correction", True) for g in opt.param_groups):
        return "bias_correction=False (torch's Adam always corrects)"
    return None


class OwnerShard:
    """The owner's side: its Adam optimizers (inside megatron's DistributedOptimizer:
    ``opt.optimizer`` of each chained optimizer), in a fixed order; one kind per shard
    (:func:`aor_kind`)."""

    def __init__(self, torch_optimizers):
        self.opts = [o for o in torch_optimizers if o is not None]
        kinds = set()
        for o in self.opts:
            kind = aor_kind(o)
            if kind is None:
                raise NotImplementedError(
                    f"AOR replays torch.optim.Adam/AdamW and apex/TransformerEngine "
                    f"FusedAdam only, not {type(o).__module__}.{type(o).__name__}")
            why = _fused_refusal(o) if kind == "fused_adam" else None
            if why:
                raise NotImplementedError(f"AOR: {type(o).__name__} with {why}: not supported")
            kinds.add(kind)
        if len(kinds) > 1:
            raise NotImplementedError(f"AOR: one optimizer kind per shard, got {sorted(kinds)}")
        self.kind = kinds.pop() if kinds else "adam"
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
                # torch keeps capturable/fused in each group (FusedAdam: refused above)
                if g.get("capturable") or g.get("fused"):
                    raise NotImplementedError("AOR: capturable/fused Adam keeps its step on "
                                              "the device; not supported")
                if g.get("amsgrad"):
                    raise NotImplementedError("AOR: amsgrad is not supported")
                for p in g["params"]:
                    st = o.state[p]
                    if "step" not in st and self.kind == "adam":  # FusedAdam: the group's
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
            if self.kind == "fused_adam":  # replayed by torch's single-tensor Adam(W)
                groups.append(GroupSpec(
                    numels=tuple(p.numel() for p in params),
                    betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                    amsgrad=False, maximize=False, foreach=False, fused=False,
                    capturable=False, differentiable=False,
                    decoupled_weight_decay=bool(getattr(self._opt_of(g), "adam_w_mode", 1))))
                continue
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
                         self.device.type, self.kind)

    def _opt_of(self, group: dict):
        return next(o for o in self.opts if any(g is group for g in o.param_groups))

    def _steps(self) -> list:
        """Each param's step count as a float32 tensor: torch's own state["step"], or
        FusedAdam's group["step"] (absent before its first step: 0) once per param."""
        if self.kind == "adam":
            return self._state("step")
        return [torch.tensor(float(g.get("step", 0)), dtype=torch.float32)
                for g in self.groups() for _ in g["params"]]

    def _state(self, key: str) -> list:
        return [o.state[p][key] for o in self.opts for g in o.param_groups
                for p in g["params"]]

    def step_count(self) -> float:
        steps = {float(s) for s in self._steps()}
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
        """Post the device -> pinned host copies on a side stream, after the work
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
            # each grad straight to its offset of the pinned message: no whole-shard
            # torch.cat on the device at the step's memory peak
            copy_flat(src, out, non_blocking=True)
            for t in src:
                t.record_stream(stream)  # not reused by the allocator before the copy
            self._copied.record(stream)

    def wait_capture(self) -> None:
        """Block until the posted gradient copy is in host memory (no-op on CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def pieces(self) -> list:
        """The owner's state in the replica's byte order (for checksums and packing)."""
        steps = torch.stack(self._steps()).to(torch.float32) if self.params() else \
            torch.empty(0)
        return [*self.params(), *self._state("exp_avg"), *self._state("exp_avg_sq"), steps]

    def checksum(self) -> int:
        """The pair's checksum of this shard (``ShardSpec.checksum``): where the replay is
        not bit-identical, computed where the state lives (a device owner: on the
        device, one scalar copied down)."""
        return self.spec.checksum(self.pieces())

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
            region(out, self.spec, "step").copy_(torch.stack(self._steps()))

    @torch.no_grad()
    def unpack_state(self, src: torch.Tensor) -> None:
        """Recovery: overwrite the shard state from a replica's bytes (uint8)."""
        numels = self.spec.numels
        for name, dst in (("param", self.params()), ("exp_avg", self._state("exp_avg")),
                          ("exp_avg_sq", self._state("exp_avg_sq"))):
            for d, s in zip(dst, _views(region(src, self.spec, name), numels)):
                d.view(-1).copy_(s)
        steps = region(src, self.spec, "step")
        if self.kind == "fused_adam":  # one count per group, as FusedAdam keeps it
            off = 0
            for g in self.groups():
                if g["params"]:
                    g["step"] = int(steps[off])
                off += len(g["params"])
            return
        for d, s in zip(self._state("step"), steps):
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
