"""Each CPU bridge is needed: its megatron-core call site works with all bridges and
fails with every bridge but that one."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training import cpu_compat

PROBE = os.path.join(os.path.dirname(__file__), "cpu_compat_probe.py")

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


@pytest.mark.parametrize("bridge", cpu_compat.BRIDGES)
def test_bridge_is_needed(bridge):
    broken = _probe(bridge, skip=bridge)
    assert broken.returncode != 0, f"{bridge}: call site worked without its bridge"
    assert "Traceback" in broken.stderr


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
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "still raises" in out.stdout
