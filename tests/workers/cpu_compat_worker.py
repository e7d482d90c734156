"""Run one megatron-core call site that needs a CPU bridge, with all bridges but
``--skip`` applied. Exit 0 when the call works. Used by test_cpu_compat.py: each bridge
must be the one thing that makes its call site work."""

import argparse
import os
import sys
import traceback


import torch


def init_world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[-1] if sys.argv[-1].isdigit() else "29555")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel()


def trigger_rng_tracker():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the forked stream advanced


def _one_param_module():
    """(config, a MegatronModule of one 8-element parameter) for DDP's init."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                            use_cpu_initialization=True)

    class M(MegatronModule):
        def __init__(self):
            super().__init__(cfg)
            self.w = torch.nn.Parameter(torch.ones(8))

    return cfg, M()


def trigger_current_device():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg, module = _one_param_module()
    DistributedDataParallel(cfg, DistributedDataParallelConfig(), module)


def trigger_synchronize():
    from megatron.core.timers import Timers

    t = Timers(log_level=0, log_option="minmax")("x", log_level=0)
    t.start()
    t.stop()


def trigger_cuda_literals():
    from megatron.core.transformer.utils import get_default_causal_mask

    assert get_default_causal_mask(4).device.type == "cpu"


def trigger_tensor_cuda():
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    gs = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_factor=2.0,
                           backoff_factor=0.5, growth_interval=1, hysteresis=1)
    gs.load_state_dict(gs.state_dict())


def trigger_tensor_type():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def trigger_streams():
    # hpZ: the partial distributed optimizer (2 instances) makes a CUDA stream for its
    # all-reduce across instances; every group of a world of one will do for DDP's init
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    cfg, module = _one_param_module()
    pgs = ProcessGroupCollection()
    for name in ("tp", "pp", "dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "ep",
                 "inter_dist_opt", "intra_dist_opt", "cp"):
        setattr(pgs, name, torch.distributed.group.WORLD)
    DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=2), module,
        pg_collection=pgs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default=None)
    ap.add_argument("--trigger", required=True)
    ap.add_argument("port")
    a = ap.parse_args()
    from megatron.training import cpu_compat

    init_world_of_one()
    bridges = [b for b in cpu_compat.BRIDGES if b != a.skip]
    cpu_compat.apply(bridges)
    for trigger in a.trigger.split(","):
        try:
            globals()["trigger_" + trigger]()
        except Exception as exc:
            # one parseable line naming the exception and the innermost megatron-core
            # call that raised it, so a test can tell the missing bridge's failure from
            # any other crash; then the normal traceback and a non-zero exit
            print(f"FAILED {trigger}: {_failure(exc)}", file=sys.stderr, flush=True)
            raise
        print("OK", trigger, flush=True)


def _failure(exc: BaseException) -> str:
    """'<Type>: <message> at megatron/core/<file>:<function>: <source line>'."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}megatron{os.sep}core{os.sep}" in f.filename]
    where = "no megatron-core frame"
    if frames:
        f = frames[-1]
        rel = f.filename[f.filename.rindex(f"{os.sep}megatron{os.sep}core{os.sep}") + 1:]
        where = f"{rel.replace(os.sep, '/')}:{f.name}: {f.line}"
    return f"{type(exc).__name__}: {exc} at {where}"


if __name__ == "__main__":
    main()
