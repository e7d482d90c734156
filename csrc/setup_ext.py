"""Build rules for the optional native extension ``reft_ext._C`` (used by setup.py).

Decisions, each printed to the build log with a ``[reft_ext]`` prefix
(``pip install -v`` shows them):

* C++ part: always attempted when pybind11 is importable.  Compiled with -O3 and
  *no* global -march: the AVX2 / AVX-512 kernels carry per-function target
  attributes and are picked at run time, so one .so runs on every x86-64 host.
* GPU part: CUDA when ``nvcc`` is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)
  AND ``import torch`` works AND ``torch.version.cuda`` is not None; ROCm when
  ``torch.version.hip`` is set and ``hipcc`` is found (the .cu sources are
  hipified into the build tree by torch.utils.hipify, or hipify-perl).
  Otherwise the GPU part is skipped.  ``REFT_BUILD_GPU=0`` forces it off; ``REFT_BUILD_GPU=1`` forces the
  CUDA part whenever nvcc exists (a compile/link check on a CPU-only torch).
* Failure never fails the install: a compile or link error prints a warning and
  the package installs without ``_C`` (reft_ext then uses its torch reference
  paths).  If only the GPU part fails, the C++ part is retried without it.

Sources are deliberately compiled against raw pointers, not torch's C++ API:
no torch headers are needed, and the .so keeps working across torch upgrades.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
CPP_SOURCES = ["csrc/bindings.cpp", "csrc/copy_engine.cpp", "csrc/xor_kernels.cpp"]
GPU_SOURCES = ["csrc/copy_cuda.cu", "csrc/xor_cuda.cu"]
EXT_NAME = "reft_ext._C"


def log(msg: str) -> None:
    # stderr: pip keeps it in the log of a failed build and shows it with -v.
    print(f"[reft_ext] {msg}", file=sys.stderr, flush=True)


def find_nvcc() -> str | None:
    cands = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cands.append(os.path.join(root, "bin", "nvcc"))
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuda_home(nvcc: str) -> str:
    """The toolkit root for nvcc (nvcc may be a wrapper script outside it)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def torch_gpu_flavour() -> tuple[str | None, str]:
    """('cuda'|'hip'|None, reason) from the torch that the install will run with."""
    try:
        import torch  # noqa: PLC0415 - optional at build time
    except Exception as exc:  # noqa: BLE001
        return None, f"torch not importable at build time ({exc.__class__.__name__})"
    if getattr(torch.version, "hip", None):
        return "hip", f"torch {torch.__version__} is a ROCm build (hip {torch.version.hip})"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is CPU-only (torch.version.cuda is None)"
    return "cuda", f"torch {torch.__version__} has CUDA {torch.version.cuda}"


def gpu_plan() -> tuple[str | None, str]:
    """Which GPU toolchain to use, and the sentence for the build log."""
    force = os.environ.get("REFT_BUILD_GPU", "")
    if force == "0":
        return None, "GPU part off: REFT_BUILD_GPU=0"
    if force == "1":  # compile/link check of the CUDA part on a CPU-only torch
        nvcc = find_nvcc()
        if nvcc is None:
            return None, "GPU part off: REFT_BUILD_GPU=1 but nvcc was not found"
        return "cuda", f"GPU part on (CUDA): forced by REFT_BUILD_GPU=1, nvcc at {nvcc}"
    flavour, why = torch_gpu_flavour()
    if flavour == "cuda":
        nvcc = find_nvcc()
        if nvcc is None:
            return None, f"GPU part off: {why} but nvcc was not found"
        return "cuda", f"GPU part on (CUDA): {why}, nvcc at {nvcc}"
    if flavour == "hip":
        if not shutil.which("hipcc"):
            return None, f"GPU part off: {why} but hipcc was not found"
        return "hip", f"GPU part on (ROCm, hipified .cu sources): {why}"
    nvcc = find_nvcc()
    extra = f"; nvcc exists at {nvcc} but is not used" if nvcc else ""
    return None, f"GPU part off: {why}{extra}"


def cuda_arch_flags() -> list[str]:
    """-gencode flags from TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX"), default A100 + H100 (+PTX)."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    flags = []
    for item in spec.replace(" ", ";").split(";"):
        if not item:
            continue
        ptx = item.endswith("+PTX")
        num = item.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:  # lets newer GPUs JIT the kernel
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _compile_gpu_objects(flavour: str, build_temp: str) -> tuple[list[str], list[str], list[str]]:
    """Compiles the .cu sources; returns (objects, library_dirs, libraries)."""
    os.makedirs(build_temp, exist_ok=True)
    objects: list[str] = []
    incs = ["-I", os.path.join(HERE)]
    if flavour == "cuda":
        nvcc = find_nvcc()
        cuda_root = cuda_home(nvcc)
        for src in GPU_SOURCES:
            obj = os.path.join(build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *cuda_arch_flags(), *incs,
                   src, "-o", obj]
            log("  " + " ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        libdirs = [d for d in (os.path.join(cuda_root, "lib64"), os.path.join(cuda_root, "lib"))
                   if os.path.isdir(d)]
        # Static cudart: the .so then needs only the driver (libcuda) at run time,
        # not a toolkit directory on the loader path of the training machine.
        return objects, libdirs, ["cudart_static", "dl", "rt"]
    # ROCm: hipify the CUDA sources into the build tree, then compile with hipcc.
    hip_dir = os.path.join(build_temp, "hipified")
    for src in hipify_sources(hip_dir):
        obj = os.path.join(build_temp, os.path.basename(src) + ".o")
        cmd = ["hipcc", "-c", "-O3", "-std=c++17", "-fPIC", "-I", hip_dir, src, "-o", obj]
        log("  " + " ".join(cmd))
        subprocess.check_call(cmd)
        objects.append(obj)
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    return objects, [os.path.join(rocm, "lib")], ["amdhip64"]


def hipify_sources(out_dir: str) -> list[str]:
    """HIP versions of GPU_SOURCES (and cuda_ops.h) in out_dir.

    torch.utils.hipify (shipped with every torch) renames files as it goes
    (copy_cuda.cu -> copy_hip.hip, cuda_ops.h -> hip_ops.h, includes rewritten);
    hipify-perl is the fallback and keeps the names."""
    # torch's hipify copies the project into out_dir only when out_dir is absent
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    try:
        from torch.utils.hipify import hipify_python  # noqa: PLC0415

        res = hipify_python.hipify(project_directory=HERE, output_directory=out_dir,
                                   includes=[os.path.join(HERE, "*")],
                                   is_pytorch_extension=True, show_progress=False)
        # result keys are the copies of the sources inside out_dir
        key = {os.path.basename(k): v for k, v in res.items()}
        outs = [key[os.path.basename(s)].hipified_path for s in GPU_SOURCES]
        if all(outs):
            return [os.path.abspath(o) for o in outs]
    except Exception as exc:  # noqa: BLE001
        log(f"torch hipify unavailable ({exc}); trying hipify-perl")
    os.makedirs(out_dir, exist_ok=True)
    outs = []
    for src in GPU_SOURCES + ["csrc/cuda_ops.h", "csrc/cuda_check.h"]:
        dst = os.path.join(out_dir, os.path.basename(src).replace(".cu", ".hip"))
        with open(dst, "w") as fh:
            subprocess.check_call(["hipify-perl", src], stdout=fh)
        outs.append(dst)
    return outs[:len(GPU_SOURCES)]


def get_ext_modules():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError as exc:
        log(f"native extension off: pybind11 not importable ({exc})")
        return []
    ext = Pybind11Extension(
        EXT_NAME,
        sources=CPP_SOURCES,
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
    )
    return [ext]


def get_cmdclass():
    try:
        from pybind11.setup_helpers import build_ext as _base
    except ImportError:
        from setuptools.command.build_ext import build_ext as _base

    class SafeBuildExt(_base):
        """build_ext that adds the GPU objects when possible and never fails the install."""

        def run(self):
            log(f"building {EXT_NAME} with {sysconfig.get_config_var('CXX') or 'c++'} "
                f"(python {sys.version.split()[0]})")
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - e.g. no compiler at all
                self._warn(exc)

        def build_extension(self, ext):
            if ext.name != EXT_NAME:
                return super().build_extension(ext)
            flavour, why = gpu_plan()
            log(why)
            if flavour is not None:
                saved = (list(ext.extra_objects), list(ext.library_dirs), list(ext.libraries),
                         list(ext.runtime_library_dirs), list(ext.define_macros))
                try:
                    objs, libdirs, libs = _compile_gpu_objects(flavour, self.build_temp)
                    ext.extra_objects += objs
                    ext.library_dirs += libdirs
                    if flavour == "hip":
                        ext.runtime_library_dirs += libdirs
                    ext.libraries += libs
                    ext.define_macros.append(("REFT_WITH_CUDA", "1"))
                    super().build_extension(ext)
                    log(f"built {EXT_NAME} with the GPU part ({flavour})")
                    return
                except Exception as exc:  # noqa: BLE001
                    log(f"WARNING: GPU part failed ({exc}); retrying CPU-only")
                    (ext.extra_objects, ext.library_dirs, ext.libraries,
                     ext.runtime_library_dirs, ext.define_macros) = saved
            try:
                super().build_extension(ext)
                log(f"built {EXT_NAME} (CPU part; AVX2/AVX-512 chosen at run time)")
            except Exception as exc:  # noqa: BLE001
                self._warn(exc)

        @staticmethod
        def _warn(exc):
            log(f"WARNING: could not build {EXT_NAME} ({exc.__class__.__name__}: {exc}); "
                "installing without it - reft_ext falls back to torch reference paths")

    return {"build_ext": SafeBuildExt}
