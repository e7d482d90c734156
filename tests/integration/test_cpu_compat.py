"""Each CPU bridge is needed: its megatron-core call site works with all bridges and
fails with every bridge but that one."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training import cpu_compat
from tests.harness.run import REPO

PROBE = os.path.join(REPO, "tests", "workers", "cpu_compat_worker.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="bridges are CPU-only")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _probe(trigger, skip=None):
    cmd = [sys.executable, PROBE, "--trigger", trigger] + (["--skip", skip] if skip else [])
    return subprocess.run(cmd + [_port()], capture_output=True, text=True, timeout=120)


def test_every_call_site_works_with_all_bridges():
    ok = _probe(",".join(cpu_compat.BRIDGES))
    assert ok.returncode == 0, ok.stderr[-3000:]
    for bridge in cpu_compat.BRIDGES:
        assert f"OK {bridge}" in ok.stdout


# torch.cuda's lazy init on a build without CUDA (the CPU wheel these tests run on), or
# on a CUDA build without a usable device
NO_CUDA = r"(AssertionError: Torch not compiled with CUDA enabled|RuntimeError: .*(NVIDIA " \
          r"driver|CUDA GPUs).*)"
# the failure each missing bridge causes (docs/foundation.md): the exception, then the
# megatron-core call that raised it, as cpu_compat_worker.py's FAILED line names them
FAILS = {
    "rng_tracker": (NO_CUDA, "megatron/core/tensor_parallel/random.py:add: "
                             "orig_rng_state = torch.cuda.get_rng_state()"),
    "current_device": (NO_CUDA, "megatron/core/distributed/param_and_grad_buffer.py:"
                                "__init__: device=torch.cuda.current_device(),"),
    "synchronize": (NO_CUDA, "megatron/core/timers.py:start: torch.cuda.synchronize()"),
    "cuda_literals": (NO_CUDA, "megatron/core/transformer/utils.py:get_default_causal_mask: "
                               'return torch.triu(torch.ones(sq, sq, device="cuda"), '
                               "diagonal=1).bool()"),
    # torch.cuda.current_device() is bridged to "cpu": Tensor.cuda("cpu") is refused
    "tensor_cuda": (r"RuntimeError: Invalid device, must be cuda device",
                    "megatron/core/optimizer/grad_scaler.py:load_state_dict: self._scale = "
                    "state_dict['scale'].cuda(torch.cuda.current_device())"),
    # a CPU tensor's type() is 'torch.FloatTensor': megatron's dtype assert fails
    "tensor_type": (r"AssertionError: ", "megatron/core/optimizer/clip_grads.py:"
                                         "clip_grad_by_total_norm_fp32: assert "
                                         "param.grad.type() == 'torch.cuda.FloatTensor'"),
    # hpZ's partial distributed optimizer: its inter-instance all-reduce stream
    "streams": (r"RuntimeError: torch.cuda.Stream requires CUDA support",
                "megatron/core/distributed/distributed_data_parallel.py:"
                "_allocate_buffers_for_parameters: communication_stream = "
                "torch.cuda.Stream(device=torch.cuda.current_device())"),
}


@pytest.mark.parametrize("bridge", cpu_compat.BRIDGES)
def test_bridge_is_needed(bridge):
    broken = _probe(bridge, skip=bridge)
    assert broken.returncode != 0, f"{bridge}: call site worked without its bridge"
    failed = re.findall(r"^(?:\[rank0\]: )?FAILED (\w+): (.*)$", broken.stderr, re.M)
    assert [t for t, _ in failed] == [bridge], broken.stderr[-3000:]
    error, call = FAILS[bridge]
    assert re.fullmatch(f"{error} at {re.escape(call)}", failed[0][1]), failed[0][1]
    assert f"OK {bridge}" not in broken.stdout


def test_unknown_bridge_rejected():
    with pytest.raises(ValueError, match="unknown cpu_compat bridges"):
        cpu_compat.apply(["nope"], force=True)


def test_tensor_methods_unchanged_outside_megatron():
    """The Tensor.cuda/.type bridges only answer megatron-core callers."""
    code = (
        "import torch\n"
        "from megatron.training import cpu_compat\n"
        "cpu_compat.apply(['tensor_cuda', 'tensor_type'])\n"
        "assert torch.ones(1).type() == 'torch.FloatTensor'\n"
        "try:\n"
        "    torch.ones(1).cuda()\n"
        "except (AssertionError, RuntimeError):\n"
        "    print('still raises')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "still raises" in out.stdout
