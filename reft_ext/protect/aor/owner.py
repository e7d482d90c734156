"""The owner's side of an AOR pair: which optimizers AOR can replay (:func:`aor_kind`),
and :class:`OwnerShard`, which reads the owner's torch optimizers: their resolved Adam
flags into a :class:`~reft_ext.protect.aor.shard_layout.ShardSpec`, each step's exact
inputs into a step message (:meth:`OwnerShard.capture`, through pinned memory on a GPU),
the whole shard state into a replica's bytes and back (seeding, recovery).

Apart from the holder's side (``replica.py``: why the replay is bit-identical, and the
replica itself): the two run on different ranks and share only ``shard_layout.py``.
Plain torch (no megatron, no torch.distributed).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from reft_ext.protect.aor.shard_layout import (HEADER_MAGIC, GroupSpec, ShardSpec, _cat_into,
                                               _views, copy_flat, region)


def aor_kind(opt) -> str | None:
    """The optimizer kinds AOR protects (the AOR column of megatron/training/
    optimizer_kinds.py's table): "adam" for torch's Adam/AdamW (replayed bit for bit on
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
