"""ROCm compile check of the GPU kernels for Frontier's MI250X (gfx90a), on a CPU machine.

The CUDA sources (csrc/copy_cuda.cu, csrc/xor_cuda.cu) are hipified by torch's hipify
and compiled by hipcc for gfx90a (no GPU needed: HIP_PLATFORM=amd), exactly as
`make hip-check` and the ROCm build (examples/frontier/build.sh) do.  Debian/Ubuntu:
`apt-get install -y hipcc libamdhip64-dev`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from csrc import setup_ext
from tests.harness.run import REPO

pytestmark = [
    pytest.mark.slow,  # two hipcc compiles, ~10 s
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("hipcc") is None,
                       reason="hipcc not found (apt-get install -y hipcc libamdhip64-dev)"),
    pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) not found"),
]


def _symbols(obj: str) -> str:
    return subprocess.run(["nm", "-C", obj], capture_output=True, text=True, check=True).stdout


def test_hipified_kernels_compile_for_gfx90a(tmp_path):
    objs = setup_ext.hip_check(str(tmp_path), "gfx90a")
    assert [os.path.basename(o) for o in objs] == ["copy_hip.hip.gfx90a.o",
                                                   "xor_hip.hip.gfx90a.o"]
    for o in objs:
        assert os.path.getsize(o) > 0
    copy_syms, xor_syms = _symbols(objs[0]), _symbols(objs[1])
    # the host entry points bindings.cpp calls (cuda_ops.h)
    for fn in ("memcpy_async", "event_query", "event_synchronize", "event_destroy",
               "host_register", "host_unregister", "device_count", "runtime_version"):
        assert re.search(rf"\sT reft::gpu::{fn}[(\[]", copy_syms), fn  # [abi:cxx11] tags
    assert "reft::gpu::xor_encode(" in xor_syms
    # the XOR kernel itself, and a device code bundle registered with the HIP runtime
    assert "xor_kernel(" in xor_syms and "__hip_fatbin" in xor_syms
    with open(objs[1], "rb") as fh:
        assert b"amdgcn-amd-amdhsa--gfx90a" in fh.read()  # code object for the MI250X


def test_make_style_cli_reports_objects(tmp_path):
    """`python -m csrc.setup_ext --hip-check DIR` (what `make hip-check` runs), with DIR
    relative to the working directory as in the Makefile."""
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "csrc.setup_ext", "--hip-check", "build/hc"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("[reft_ext] hip-check:") == 2
    assert os.path.isfile(tmp_path / "build" / "hc" / "xor_hip.hip.gfx90a.o")
