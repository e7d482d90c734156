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
* One CUDA runtime: the CUDA part links the *shared* libcudart (never cudart_static),
  and only when nvcc's CUDA major equals torch's (``torch.version.cuda``), so the
  loader hands the extension the libcudart torch already loaded (same SONAME) and
  streams, events and errors are shared with torch.  ROCm links the shared
  libamdhip64 of $ROCM_PATH, which resolves the same way, and only when its HIP major
  equals torch's (``torch.version.hip``: same SONAME, libamdhip64.so.N).  torch's
  CUDAExtension is not used because it also links libtorch*;
  these sources need no torch headers (see below).
* Failure never fails the install: a compile or link error prints a warning and
  the package installs without ``_C`` (reft_ext then uses its torch reference
  paths).  If only the GPU part fails, the C++ part is retried without it.

Sources are deliberately compiled against raw pointers, not torch's C++ API:
no torch headers are needed, and the .so keeps working across torch upgrades.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
CPP_SOURCES = ["csrc/bindings.cpp", "csrc/copy_engine.cpp", "csrc/copy_hash.cpp",
               "csrc/xor_kernels.cpp"]
GPU_SOURCES = ["csrc/copy_cuda.cu", "csrc/xor_cuda.cu"]
EXT_NAME = "reft_ext._C"
# The process groups of an in-process restart: needs torch's headers and links libtorch,
# so it is its own extension, built for the torch it is installed with (csrc/group_backend.cpp)
GROUPS_EXT_NAME = "reft_ext._groups"
GROUPS_SOURCES = ["csrc/group_backend.cpp"]


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


def nvcc_cuda_major(nvcc: str) -> int | None:
    """CUDA major of nvcc ("release 13.0" -> 13), None when it cannot be read."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def torch_cudart_dirs() -> list[str]:
    """Directories holding the libcudart.so.* a pip CUDA torch loads (nvidia/*/lib)."""
    try:
        import nvidia  # noqa: PLC0415 - namespace package of the nvidia-*-cu* wheels
    except ImportError:
        return []
    found = []
    for root in getattr(nvidia, "__path__", []):
        found += glob.glob(os.path.join(root, "*", "lib", "libcudart.so.*"))
    return sorted({os.path.dirname(f) for f in found})


def cudart_link_plan(nvcc: str) -> tuple[list[str], list[str], str]:
    """(library_dirs, runtime_library_dirs, log line) for linking the shared libcudart.

    Raises RuntimeError when nvcc's CUDA major differs from torch's: the .so would
    then load a second libcudart (another SONAME) beside torch's."""
    root = cuda_home(nvcc)
    libdirs = [d for d in (os.path.join(root, "lib64"), os.path.join(root, "lib"))
               if os.path.isdir(d)]
    flavour, _ = torch_gpu_flavour()
    major = nvcc_cuda_major(nvcc)
    if flavour == "cuda":
        import torch  # noqa: PLC0415

        torch_major = int(str(torch.version.cuda).split(".")[0])
        if major is not None and major != torch_major:
            raise RuntimeError(
                f"nvcc is CUDA {major} but torch was built with CUDA {torch.version.cuda}: "
                f"the extension would load a second CUDA runtime; put a CUDA {torch_major} "
                "nvcc first on PATH (or set CUDA_HOME)")
    # torch's own runtime first on the search path; the toolkit's for a CPU-only torch
    rpath = torch_cudart_dirs() + libdirs
    return libdirs, rpath, (f"linking shared libcudart (CUDA {major}); run-time search path "
                            f"{':'.join(rpath)} (torch's runtime when torch already loaded it)")


def parse_hip_version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a HIP version as torch ("6.2.41133-dd7f95766"), hipconfig or
    hip_version.h report it; None when it cannot be read."""
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def rocm_hip_version(rocm: str) -> tuple[int, int] | None:
    """(major, minor) of the HIP runtime under ``rocm`` ($ROCM_PATH): its
    include/hip/hip_version.h, else ``hipconfig --version``."""
    header = os.path.join(rocm, "include", "hip", "hip_version.h")
    if os.path.isfile(header):
        text = open(header).read()
        parts = [re.search(rf"#define\s+HIP_VERSION_{k}\s+(\d+)", text) for k in
                 ("MAJOR", "MINOR")]
        if all(parts):
            return int(parts[0].group(1)), int(parts[1].group(1))
    hipconfig = os.path.join(rocm, "bin", "hipconfig")
    for exe in (hipconfig, shutil.which("hipconfig")):
        if exe and os.path.exists(exe):
            try:
                out = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                     timeout=60).stdout
            except Exception:  # noqa: BLE001
                continue
            if parse_hip_version(out):
                return parse_hip_version(out)
    return None


def hip_link_plan(rocm: str, torch_hip: str | None = None) -> tuple[list[str], str]:
    """(library_dirs, log line) for linking $ROCM_PATH's shared libamdhip64, checked
    against torch's HIP (``torch.version.hip``) as the CUDA build checks nvcc's major:
    another major is another SONAME (libamdhip64.so.N), a second HIP runtime beside
    torch's with its own streams and errors, so the build refuses (RuntimeError); another
    minor shares the SONAME (the loader hands over torch's) and is only logged."""
    if torch_hip is None:
        import torch  # noqa: PLC0415

        torch_hip = getattr(torch.version, "hip", None)
    libdirs = [os.path.join(rocm, "lib")]
    mine, theirs = rocm_hip_version(rocm), parse_hip_version(torch_hip)
    if mine and theirs and mine[0] != theirs[0]:
        raise RuntimeError(
            f"ROCM_PATH={rocm} has HIP {mine[0]}.{mine[1]} but torch was built with HIP "
            f"{torch_hip}: the extension would load a second HIP runtime; load the rocm "
            f"module of torch's ROCm {theirs[0]}.x (or set ROCM_PATH)")
    note = "" if not (mine and theirs and mine != theirs) else \
        f" (torch's is {theirs[0]}.{theirs[1]}: same SONAME, torch's runtime is used)"
    found = f"HIP {mine[0]}.{mine[1]}" if mine else "HIP of unknown version"
    return libdirs, f"linking shared libamdhip64 of {rocm} ({found}){note}"


def hip_arch_flags() -> list[str]:
    """--offload-arch per target of PYTORCH_ROCM_ARCH (torch's variable, "gfx90a;gfx942")."""
    spec = os.environ.get("PYTORCH_ROCM_ARCH", "")
    return [f"--offload-arch={a}" for a in spec.replace(" ", ";").split(";") if a]


def hip_compile_cmd(src: str, obj: str, include_dir: str, arch_flags: list[str]) -> list[str]:
    """The hipcc command for one hipified source (shared by the build and `make hip-check`)."""
    return ["hipcc", "-c", "-O3", "-std=c++17", "-fPIC", *arch_flags, "-I", include_dir,
            src, "-o", obj]


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


def _compile_gpu_objects(flavour: str, build_temp: str):
    """Compiles the .cu sources; returns (objects, library_dirs, runtime_dirs, libraries)."""
    os.makedirs(build_temp, exist_ok=True)
    objects: list[str] = []
    incs = ["-I", os.path.join(HERE)]
    if flavour == "cuda":
        nvcc = find_nvcc()
        for src in GPU_SOURCES:
            obj = os.path.join(build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", *cuda_arch_flags(), *incs,
                   src, "-o", obj]
            log("  " + " ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        libdirs, rpath, why = cudart_link_plan(nvcc)
        log(why)
        # shared libcudart: the one torch loaded (cudart_static would be a second runtime
        # with its own error state and no view of torch's streams' errors)
        return objects, libdirs, rpath, ["cudart"]
    # ROCm: torch's HIP checked first, then the CUDA sources hipified into the build
    # tree and compiled with hipcc.
    libdirs, why = hip_link_plan(os.environ.get("ROCM_PATH", "/opt/rocm"))
    hip_dir = os.path.join(build_temp, "hipified")
    for src in hipify_sources(hip_dir):
        obj = os.path.join(build_temp, os.path.basename(src) + ".o")
        cmd = hip_compile_cmd(src, obj, hip_dir, hip_arch_flags())
        log("  " + " ".join(cmd))
        subprocess.check_call(cmd)
        objects.append(obj)
    log(why)
    return objects, libdirs, libdirs, ["amdhip64"]


def hipify_sources(out_dir: str) -> list[str]:
    """HIP versions of GPU_SOURCES (and cuda_ops.h) in out_dir.

    torch.utils.hipify (shipped with every torch) renames files as it goes
    (copy_cuda.cu -> copy_hip.hip, cuda_ops.h -> hip_ops.h, includes rewritten);
    hipify-perl is the fallback and keeps the names."""
    # torch's hipify copies the project into out_dir only when out_dir is absent; it
    # mishandles a relative out_dir (joins it twice)
    out_dir = os.path.abspath(out_dir)
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
    return [ext] + groups_extension()


def groups_extension() -> list:
    """reft_ext._groups, built as torch.utils.cpp_extension would build it (the same
    flags: torch's bundled pybind11, so its Backend objects pass to and from Python).
    ``REFT_BUILD_GROUPS=0`` leaves it out (a build of _C alone)."""
    if os.environ.get("REFT_BUILD_GROUPS") == "0":
        log(f"{GROUPS_EXT_NAME} off (REFT_BUILD_GROUPS=0)")
        return []
    try:
        from torch.utils.cpp_extension import CppExtension  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        log(f"{GROUPS_EXT_NAME} off: torch.utils.cpp_extension not importable ({exc})")
        return []
    name = GROUPS_EXT_NAME.rsplit(".", 1)[1]
    return [CppExtension(GROUPS_EXT_NAME, GROUPS_SOURCES, extra_compile_args=[
        "-O2", "-std=c++20", f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H"])]


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
            if ext.name == GROUPS_EXT_NAME:
                try:
                    super().build_extension(ext)
                    log(f"built {GROUPS_EXT_NAME} (process groups kept across restarts)")
                except Exception as exc:  # noqa: BLE001
                    log(f"WARNING: could not build {GROUPS_EXT_NAME} ({exc}); in-process "
                        "restarts rebind process-group references instead")
                return None
            if ext.name != EXT_NAME:
                return super().build_extension(ext)
            flavour, why = gpu_plan()
            log(why)
            if flavour is not None:
                saved = (list(ext.extra_objects), list(ext.library_dirs), list(ext.libraries),
                         list(ext.runtime_library_dirs), list(ext.define_macros))
                try:
                    objs, libdirs, rpath, libs = _compile_gpu_objects(flavour, self.build_temp)
                    ext.extra_objects += objs
                    ext.library_dirs += libdirs
                    ext.runtime_library_dirs += rpath
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


def hip_check(out_dir: str, arch: str = "gfx90a") -> list[str]:
    """Hipifies GPU_SOURCES into out_dir and compiles them for `arch` with hipcc on any
    machine (no GPU needed; HIP_PLATFORM=amd): the ROCm build's compile check, e.g.
    Frontier's MI250X (gfx90a).  Returns the object files; raises on a compile error."""
    if not shutil.which("hipcc"):
        raise FileNotFoundError("hipcc not found: apt-get install -y hipcc libamdhip64-dev "
                                "(Debian), or load a rocm module")
    hip_dir = os.path.join(out_dir, "hipified")
    env = dict(os.environ, HIP_PLATFORM="amd")
    objects = []
    for src in hipify_sources(hip_dir):
        obj = os.path.join(out_dir, os.path.basename(src) + f".{arch}.o")
        cmd = hip_compile_cmd(src, obj, hip_dir, [f"--offload-arch={arch}"])
        log("  " + " ".join(cmd))
        subprocess.check_call(cmd, env=env)
        objects.append(obj)
    return objects


if __name__ == "__main__":  # `python -m csrc.setup_ext --hip-check DIR [ARCH]` (make hip-check)
    if len(sys.argv) < 3 or sys.argv[1] != "--hip-check":
        sys.exit("usage: python -m csrc.setup_ext --hip-check OUT_DIR [ARCH (default gfx90a)]")
    try:
        objs = hip_check(sys.argv[2], *(sys.argv[3:4] or []))
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        sys.exit(f"[reft_ext] hip-check failed: {exc}")
    for o in objs:
        print(f"[reft_ext] hip-check: {o} ({os.path.getsize(o)} bytes)")
