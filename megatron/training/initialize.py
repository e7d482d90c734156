"""Process start-up: torch.distributed, megatron-core's parallel groups, CPU bridges, seeds."""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from megatron.training import cpu_compat, inprocess_generation
from megatron.training.arguments import rank_order
from reft_ext.cluster import rendezvous
from reft_ext.report.events import emit


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_backend(requested: str | None, cuda: bool) -> str:
    """NCCL where there is CUDA, gloo where there is none; --distributed-backend
    overrides, but NCCL without a CUDA device is refused by name."""
    backend = requested or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise RuntimeError("--distributed-backend nccl: no CUDA device here; use gloo")
    return backend


def initialize_distributed(args) -> None:
    """Join the process group (torchrun's env://, or a one-rank group on loopback)."""
    cuda = torch.cuda.is_available()
    backend = distributed_backend(args.distributed_backend, cuda)
    if "RANK" not in os.environ:  # plain `python pretrain_llama.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    if cuda:  # before the process group: NCCL binds each rank's communicators to it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if cuda and backend == "gloo":  # several ranks on one GPU (tools/gpu_multirank.py)
        from megatron.training import gloo_device

        gloo_device.install()
    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        # under the in-process supervisor: this generation's store prefix
        # (under torchrun: the job's signed store, rank 0's bound to MASTER_ADDR)
        store = inprocess_generation.store_kwargs(timeout) or \
            rendezvous.worker_store_kwargs(timeout)
        backend = inprocess_generation.group_backend(backend)  # reft_gloo: kept across restarts
        torch.distributed.init_process_group(backend=backend, timeout=timeout, **store)
    warning = rendezvous.launch_warning()  # plain torchrun: what is exposed, once
    if warning and torch.distributed.get_rank() == 0:
        emit("launch_unsafe", warning)
    ws = torch.distributed.get_world_size()
    if ws != args.world_size:
        raise RuntimeError(f"WORLD_SIZE {args.world_size} at argument validation, "
                           f"{ws} in the process group")
    # before any megatron-core object exists: bridges for a machine without CUDA
    cpu_compat.apply()
    with inprocess_generation.persistent_gloo(mpu):
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            order=rank_order(args),
            # hpZ (--zero-hpz-partition-size): the partial distributed optimizer's groups
            num_distributed_optimizer_instances=getattr(
                args, "num_distributed_optimizer_instances", 1),
            # with NCCL the gloo twins of the groups carry host tensors (REFT's snapshots,
            # checksums and object collectives); megatron-core's default, stated because
            # REFT depends on it
            create_gloo_process_groups=True,
        )
    inprocess_generation.after_initialize()  # the groups an in-process restart rebinds


def set_random_seed(seed: int) -> None:
    """Megatron's seeding: one seed per pipeline stage, the TP tracker on top.

    All data-parallel replicas share a seed, so they initialise identical weights.
    """
    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def configure_cpu_threads() -> None:
    """One intra-op thread per rank unless told otherwise: ranks share the cores, and a
    fixed thread count keeps CPU reductions (and so the losses) bit-reproducible."""
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def initialize_megatron(args) -> None:
    configure_cpu_threads()
    initialize_distributed(args)
    set_random_seed(args.seed)
