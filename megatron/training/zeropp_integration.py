"""The trainer's seam for ZeRO++ (reft_ext/zeropp/): megatron-core's distributed optimizer
all-gathers parameters and reduce-scatters gradients through two module globals of
megatron/core/distributed/param_and_grad_buffer.py (``dist_all_gather_func``,
``dist_reduce_scatter_func``; megatron-core swaps the latter itself for its fp32-
accumulating reduce-scatter). With ``--zero-quantized-weights`` /
``--zero-quantized-gradients`` they become :class:`reft_ext.zeropp.collectives.ZeroPPComm`'s
methods, installed once the model and optimizer exist; nothing of megatron-core is copied.

``REFT_ZEROPP_COUNT=1`` installs the same wrappers without quantizing, so an unquantized
run counts its bytes on the wire the same way (benchmarks/bench_zeropp.py)."""

from __future__ import annotations

import os

import torch

from reft_ext.zeropp.config import ZeroPPConfig

COUNT_ENV = "REFT_ZEROPP_COUNT"


def dp_groups_of_job(group) -> list[list[int]]:
    """Every data-parallel group of the job, the same list on every rank (collective)."""
    mine = sorted(torch.distributed.get_process_group_ranks(group))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return sorted({tuple(g) for g in every})


def install(args):
    """ZeroPPComm wired into megatron-core, or None (ZeRO++ off and not counting)."""
    cfg = ZeroPPConfig.from_args(args)
    if not cfg.enabled and os.environ.get(COUNT_ENV) != "1":
        return None
    if not args.use_distributed_optimizer:
        return None  # (counting only: nothing to count without the distributed optimizer)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from reft_ext.zeropp.collectives import ZeroPPComm

    # the group megatron-core passes: the whole data-parallel group, or with hpZ the
    # partition (its all-gather and reduce-scatter stay inside it)
    group = mpu.get_data_parallel_group(with_context_parallel=True,
                                        partial_data_parallel=cfg.hpz)
    comm = ZeroPPComm(cfg, [list(g) for g in dp_groups_of_job(group)], cfg.node_size,
                      backend=torch.distributed.get_backend(group),
                      instances=getattr(args, "num_distributed_optimizer_instances", 1))
    pgb.dist_all_gather_func = comm.all_gather
    pgb.dist_reduce_scatter_func = comm.reduce_scatter
    return comm


def bytes_text(comm, iterations: int) -> str:
    """The log line's part: bytes each rank put on the wire per step, inside / across
    nodes, for the weight all-gather and the gradient reduce-scatter."""
    if comm is None or not iterations:
        return ""
    s, mb = comm.take(), 1e6 * iterations
    return (f" zero++ MB/step (intra/inter): weights {s['weights']['intra'] / mb:.3f}/"
            f"{s['weights']['inter'] / mb:.3f}, grads {s['gradients']['intra'] / mb:.3f}/"
            f"{s['gradients']['inter'] / mb:.3f} |")
