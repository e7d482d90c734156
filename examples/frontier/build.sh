#!/bin/bash
# Build this project's Python environment on Frontier: a venv with PyTorch's ROCm wheel,
# megatron-core and this project, and the ROCm build of the native extension reft_ext._C.
# Run it once per software stack, on a login node (pip needs the internet):
#
#     export VENV=/ccs/proj/<project>/$USER/reft-venv
#     export TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4   # see below
#     bash examples/frontier/build.sh
#
# torch must be 2.13.0, the version this project pins (constraints.txt); the wheel index
# decides its ROCm. Pick the index whose ROCm is the one of the rocm module in env.sh
# (ROCM_MODULE_VERSION), or older: the wheel bundles its own HIP runtime and RCCL, which
# must not be newer than the node's driver supports.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
: "${VENV:?set VENV to where the venv goes (a project filesystem, not Lustre: env.sh)}"
: "${TORCH_INDEX_URL:?set TORCH_INDEX_URL to the PyTorch ROCm wheel index matching the rocm module}"
export VENV
# modules and build settings only: the venv does not exist yet
REFT_ENV_NO_VENV=1
# shellcheck source=examples/frontier/env.sh
source "$REPO/examples/frontier/env.sh"
LOG=${LOG:-$REPO/build-frontier.log}
: >"$LOG"

echo "== venv $VENV (python: $(command -v python3))"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# The project pins torch==2.13.0 (the ROCm wheel 2.13.0+rocmX.Y satisfies it): pip may
# never swap it for a CUDA or CPU wheel while resolving megatron-core's dependencies.
export PIP_CONSTRAINT=$REPO/constraints.txt

echo "== torch 2.13.0 from $TORCH_INDEX_URL"
python -m pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0" | tee -a "$LOG"
python - <<'EOF'
import torch
if not torch.version.hip:
    raise SystemExit(f"torch {torch.__version__} is not a ROCm build (torch.version.hip is "
                     f"None): check TORCH_INDEX_URL")
print(f"torch {torch.__version__}, HIP {torch.version.hip}, "
      f"{torch.cuda.device_count()} GPU(s) visible here")
EOF

echo "== build tools, then the project"
python -m pip install -q "setuptools>=64" wheel "pybind11>=2.10"
# reft_ext._C: csrc/setup_ext.py takes the GPU part as ROCm when torch.version.hip is set
# and hipcc is on PATH (the rocm module): it hipifies csrc/*.cu into the build tree with
# torch.utils.hipify, compiles them with hipcc and links libamdhip64 from $ROCM_PATH/lib.
# The GPU target is PYTORCH_ROCM_ARCH (env.sh, gfx90a: the MI250X), which setup_ext turns
# into --offload-arch (a login node has no GPU for hipcc to detect).
# First the same compile as `make hip-check`, which fails loudly (the install below never
# fails because of _C): the hipified kernels for each target, objects in build/hip-check.
for arch in ${PYTORCH_ROCM_ARCH//;/ }; do
    (cd "$REPO" && python -m csrc.setup_ext --hip-check build/hip-check "$arch") 2>&1 | tee -a "$LOG"
done
# -v shows the extension's decisions, one "[reft_ext] ..." line each; the build never
# fails the install (without _C, reft_ext uses its torch paths, bit-identical but slower)
python -m pip install -v --no-build-isolation -e "${REPO}[test]" >>"$LOG" 2>&1 ||
    { tail -n 30 "$LOG"; exit 1; }
grep '\[reft_ext\]' "$LOG" || true

echo "== check"
python - <<'EOF'
import reft_ext._native as n
info = n.info()
print("reft_ext native engine:", info)
if not info.get("native"):
    print("WARNING: reft_ext._C did not build: see the [reft_ext] lines above")
elif not info.get("cuda"):
    print("WARNING: reft_ext._C has no GPU part: hipcc missing, or the HIP compile failed "
          "(the [reft_ext] lines above say which)")
EOF
cat <<EOF

Done. The full build log is $LOG. Check the extension again any time (a compute node
shows the GPUs too):

    source $REPO/examples/frontier/env.sh
    python -c "import reft_ext._native as n; print(n.info())"

It prints native True and cuda True (the HIP part reports as "cuda") when the ROCm build
worked. Then try examples/slurm/tiny_cpu.sbatch, and submit
examples/frontier/llama2_34b.sbatch (examples/README.md).
EOF
