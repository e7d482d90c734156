"""Build plumbing of reft_ext._C: what was built, the GPU decision, the CUDA sources compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from csrc import setup_ext
from reft_ext import _native
from tests.harness.run import REPO

pytestmark = pytest.mark.timeout(240)

ROOT = REPO
CSRC = os.path.join(ROOT, "csrc")


@pytest.mark.skipif(_native.C is None, reason=f"reft_ext._C not loaded: {_native.REASON}")
def test_extension_reports_its_build():
    C = _native.C
    assert "compiler=" in C.BUILD_INFO and "best_isa=" in C.BUILD_INFO
    feats = C.cpu_features()
    assert feats["best"] in ("scalar", "avx2", "avx512")
    assert C.num_cpus() >= 1
    assert _native.info()["native"] is True


def test_gpu_plan_follows_torch_and_env(monkeypatch):
    import torch  # noqa: PLC0415

    flavour, why = setup_ext.gpu_plan()
    if torch.version.cuda is None and not getattr(torch.version, "hip", None):
        assert flavour is None and "CPU-only" in why
    monkeypatch.setenv("REFT_BUILD_GPU", "0")
    assert setup_ext.gpu_plan() == (None, "GPU part off: REFT_BUILD_GPU=0")


def _nvcc():
    return setup_ext.find_nvcc()


def test_cuda_arch_flags(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert setup_ext.cuda_arch_flags() == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]


@pytest.mark.slow  # an nvcc build (~25 s); the CPU build is tested in the default tier
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_gpu_variant_builds_links_and_imports(tmp_path):
    """REFT_BUILD_GPU=1 runs the real build_ext with the CUDA part (nvcc compiles the .cu
    files, g++ the bindings with REFT_WITH_CUDA, linked to cudart); the module then imports
    and reports zero devices on a machine without a GPU."""
    env = dict(os.environ, REFT_BUILD_GPU="1", TORCH_CUDA_ARCH_LIST="9.0",
               REFT_BUILD_GROUPS="0")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                        str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert "built reft_ext._C with the GPU part (cuda)" in r.stderr, r.stderr[-3000:]
    probe = (
        "import glob, importlib.util as u, sys\n"
        "p = glob.glob(sys.argv[1] + '/reft_ext/_C*.so')[0]\n"
        "spec = u.spec_from_file_location('reft_ext._C', p)\n"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.HAS_CUDA, m.cuda_device_count() >= 0, 'gpu=cuda' in m.BUILD_INFO)\n")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "lib")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True"]
    # one CUDA runtime: the shared libcudart (the one torch loads), never cudart_static
    so = next((tmp_path / "lib" / "reft_ext").glob("_C*.so"))
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    assert "libcudart.so" in dyn, dyn
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True,
                          text=True).stdout
    assert "cudaMemcpyAsync" not in syms  # a static runtime would define it inside _C


def test_cuda_link_plan_is_shared_cudart_of_torchs_major(monkeypatch):
    """The CUDA part links -lcudart (shared) and refuses an nvcc of another CUDA major than
    torch's, which would load a second runtime beside torch's."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    import torch  # noqa: PLC0415

    major = setup_ext.nvcc_cuda_major(nvcc)
    assert major is not None and major >= 10
    libdirs, rpath, why = setup_ext.cudart_link_plan(nvcc)  # CPU torch: the toolkit's runtime
    assert any(os.path.isfile(os.path.join(d, "libcudart.so")) for d in libdirs)
    assert set(libdirs) <= set(rpath) and "shared libcudart" in why
    monkeypatch.setattr(setup_ext, "torch_gpu_flavour", lambda: ("cuda", "test"))
    monkeypatch.setattr(torch.version, "cuda", f"{major - 1}.8")
    with pytest.raises(RuntimeError, match="second CUDA runtime"):
        setup_ext.cudart_link_plan(nvcc)
    monkeypatch.setattr(torch.version, "cuda", f"{major}.0")
    assert setup_ext.cudart_link_plan(nvcc)[0] == libdirs


def test_cuda_sources_never_read_back_the_shared_last_error():
    """Error checks report the failing call's own return code; the thread's last-error slot
    (which torch reads after its launches) is only cleared by clear_own_error, and kernels
    are launched through cudaLaunchKernel (its return code) rather than <<<>>>."""
    for name in ("copy_cuda.cu", "xor_cuda.cu"):
        text = re.sub(r"//[^\n]*", "", open(os.path.join(CSRC, name)).read())  # code only
        assert "cudaGetLastError" not in text and "<<<" not in text, name
        assert "\"cudart_static\"" not in open(os.path.join(CSRC, "setup_ext.py")).read()
    check = open(os.path.join(CSRC, "cuda_check.h")).read()
    assert check.count("cudaGetLastError()") == 1  # inside clear_own_error only
    assert "cudaPeekAtLastError() == own" in check


def test_hipify_produces_hip_sources(tmp_path):
    """The ROCm build path: the .cu sources hipify to HIP with no CUDA runtime calls left."""
    pytest.importorskip("torch.utils.hipify")
    outs = setup_ext.hipify_sources(str(tmp_path / "hip"))
    assert len(outs) == len(setup_ext.GPU_SOURCES)
    text = "".join(open(p).read() for p in outs)
    assert "hipMemcpyAsync" in text and "hipHostRegister" in text and "hipLaunchKernel(" in text
    assert "cudaMemcpyAsync" not in text and "cuda_runtime.h" not in text
    # the shared error-check header is converted too
    import glob

    headers = [open(p).read() for p in glob.glob(str(tmp_path / "hip" / "*check*.h"))]
    assert any("hipGetErrorString" in h and "cudaGetErrorString" not in h for h in headers)
