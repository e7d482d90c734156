"""A rank's training state, derived from the model shape and the layout, as meta tensors.

The list has the names, shapes, dtypes and order of ``TrainingState.state_tensors()`` in
a real run (model parameters of every model chunk, then the optimizer's main params where
they own storage, then Adam's moments), and is split into replicated / owned as
``MegatronStateAdapter`` does. The tensors live on the meta device, so a 34B model's
per-rank state is sized without allocating it, and fed to the same
:class:`reft_ext.state.layout.StateLayout` and :func:`reft_ext.protect.schemes.snapshot_regions` as
real snapshots (tests/integration/test_plan.py checks the result against a real run's manifests).

The distributed optimizer's shards follow megatron-core 0.16.1 with the trainer's DDP
config (``overlap_grad_reduce=False``, so one bucket per model chunk):
``_ParamAndGradBuffer`` lays a chunk's parameters out in reverse order, each start padded
to 64 elements, the bucket's end padded to lcm(DP, 128); DP rank r owns elements
[r n / DP, (r + 1) n / DP) and one shard of every parameter that range touches
(``DistributedOptimizer._build_model_gbuf_param_range_map``). Optimizer param groups:
weight-decayed (>= 2-D) first, then the no-decay 1-D params (``_get_param_groups``);
inside a group the distributed optimizer lists shards chunk by chunk in buffer order, the
plain one lists parameters in forward order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reft_ext.state.layout import StateLayout
from reft_ext.plan.model import ModelConfig, ParallelConfig
from reft_ext.protect.placement import Placement, place, placement_problem
from reft_ext.protect.schemes import make_protection, snapshot_regions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Param:
    name: str                 # as in TrainingState: model<chunk>.<named_parameters name>
    shape: tuple[int, ...]
    chunk: int
    dtype: torch.dtype        # the local spec's torch RMSNorm keeps fp32 weights

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stage_params(model: ModelConfig, par: ParallelConfig, pp_rank: int) -> list[Param]:
    """The parameters of every model chunk of pipeline stage ``pp_rank`` (any TP rank)."""
    vpp, tp = par.vpp(model), par.tp
    per_chunk = model.num_layers // par.pp // vpp
    h, vocab = model.hidden_size, model.padded_vocab_size(tp)
    dt = DTYPES[model.precision]
    out = []
    for c in range(vpp):
        names = []
        if pp_rank == 0 and c == 0:
            names.append(("embedding.word_embeddings.weight", (vocab // tp, h)))
        for i in range(per_chunk):
            names += [(f"decoder.layers.{i}.{n}", s) for n, s in model.layer_shapes(tp)]
        if pp_rank == par.pp - 1 and c == vpp - 1:
            names += [("decoder.final_layernorm.weight", (h,)),
                      ("output_layer.weight", (vocab // tp, h))]
        out += [Param(f"model{c}.{n}", s, c, torch.float32 if "norm" in n else dt)
                for n, s in names]
    return out


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def zero1_shards(params: list[Param], dp: int, dp_rank: int) -> list[tuple[Param, int]]:
    """(param, shard numel) of the parameters whose optimizer state DP rank ``dp_rank``
    owns, in the optimizer's buffer order: chunk by chunk, one buffer per param dtype (in
    order of first appearance), parameters reversed with 64-element aligned starts, the
    bucket padded to lcm(DP, 128)."""
    out = []
    for chunk in sorted({p.chunk for p in params}):
        in_chunk = [p for p in params if p.chunk == chunk]
        for dtype in dict.fromkeys(p.dtype for p in in_chunk):
            index, start = [], 0
            for p in reversed([p for p in in_chunk if p.dtype == dtype]):
                start = _pad(start, 64)
                index.append((p, start, start + p.numel))
                start += p.numel
            size = _pad(start, math.lcm(dp, 128)) // dp
            lo, hi = dp_rank * size, (dp_rank + 1) * size
            out += [(p, min(e, hi) - max(s, lo)) for p, s, e in index if min(e, hi) > max(s, lo)]
    return out


def rank_tensors(model: ModelConfig, par: ParallelConfig, pp_rank: int, dp_rank: int):
    """(replicated, owned): lists of (name, meta tensor) of one rank, as
    ``MegatronStateAdapter`` splits ``TrainingState.state_tensors()``."""
    params = stage_params(model, par, pp_rank)
    model_t = [(p.name, torch.empty(p.shape, dtype=p.dtype, device="meta")) for p in params]
    if par.use_distributed_optimizer:  # per group: fp32 shards first, then half ones
        shards = zero1_shards(params, par.dp, dp_rank)
        opt = [(p, (n,)) for group in (True, False) for fp32 in (True, False)
               for p, n in shards if (len(p.shape) > 1) == group
               and (p.dtype == torch.float32) == fp32]
    else:  # Float16Optimizer swaps main copies in place: order unchanged
        opt = [(p, p.shape) for group in (True, False) for p in params
               if (len(p.shape) > 1) == group]
    opt_t = []
    for j, (p, shape) in enumerate(opt):
        # fp32 params are their own main params (views of the model param: not listed)
        keys = ("exp_avg", "exp_avg_sq") if p.dtype == torch.float32 else \
            ("main", "exp_avg", "exp_avg_sq")
        opt_t += [(f"optim.{k}{j}", torch.empty(shape, dtype=torch.float32, device="meta"))
                  for k in keys]
    if par.use_distributed_optimizer:
        return model_t, opt_t
    return model_t + opt_t, []


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


@dataclass
class RankSnapshot:
    """One rank's snapshot, sized by the real snapshot code (``layout`` is a
    :class:`StateLayout` over meta tensors)."""

    rank: int
    node: int
    stage: int
    tp_rank: int
    member: int
    layout: StateLayout
    regions: dict
    params: int               # model parameter elements
    model_bytes: int
    optimizer_bytes: int
    param_shard_numel: int    # elements of the params whose optimizer state it owns

    @property
    def slice_bytes(self) -> int:
        return self.layout.slice_bytes

    @property
    def slot_bytes(self) -> int:
        return sum(n for _, n in self.regions.values())

    @property
    def state_bytes(self) -> int:
        return self.model_bytes + self.optimizer_bytes

    def manifest(self) -> dict:
        """The fields a real snapshot's manifest (rank<r>.slot<s>.json) has for this rank."""
        return {"layout": self.layout.signature(), "nbytes": self.slot_bytes,
                "regions": {k: list(v) for k, v in self.regions.items()}}


def group_placement(par: ParallelConfig, rank: int, redundancy: str = "arc",
                    node_of=None) -> Placement:
    """The placement of ``rank``'s sharding group, as REFT-save would place it; one that
    protects nothing (the plan reports why) is sized as if every member had its node."""
    tp_rank, _, pp_rank = par.coords(rank)
    group = [par.rank(tp_rank, d, pp_rank) for d in range(par.dp)]
    of = node_of or par.ranks_per_node
    if placement_problem(group, of, redundancy if redundancy != "none" else "arc"):
        return place(group)
    return place(group, of)


def rank_snapshot(model: ModelConfig, par: ParallelConfig, rank: int, redundancy: str,
                  node_of=None) -> RankSnapshot:
    """Size the snapshot of global rank ``rank`` under ``redundancy`` (none/arc/aec)."""
    tp_rank, dp_rank, pp_rank = par.coords(rank)
    rep, own = rank_tensors(model, par, pp_rank, dp_rank)
    protection = make_protection(redundancy, group_placement(par, rank, redundancy, node_of))
    layout = StateLayout(rep, own, par.dp, dp_rank, protection.sub_blocks())
    model = [t for t in rep + own if not t[0].startswith("optim.")]
    optim = [t for t in rep + own if t[0].startswith("optim.")]
    shard_numel = sum(t.numel() for n, t in optim if n.startswith("optim.exp_avg_sq")) \
        if par.use_distributed_optimizer else 0
    node = node_of(rank) if node_of else rank // par.ranks_per_node
    return RankSnapshot(rank, node, pp_rank, tp_rank, dp_rank, layout,
                        snapshot_regions(layout, protection),
                        sum(t.numel() for _, t in model), nbytes(model), nbytes(optim),
                        shard_numel)
