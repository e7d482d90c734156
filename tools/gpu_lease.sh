#!/bin/bash
# The GPU checks on a bare CUDA machine that has torch but none of this project's other
# dependencies (a lent device with no package registry): wheels carried in .whl/
# (megatron-core for that machine's Python) are installed to a private directory, the
# native extension is built in place for that machine's torch and CUDA, then
#
#  1. the CUDA tests (kernel parity, device staging, the trainer's GPU path, AOR's D2H);
#  2. a paper-size model on the one GPU (GPU_LEASE_MODEL, default llama2-1.3b; "none"
#     skips it): iteration time without snapshots and with one every iteration (HAS)
#     for each --reft-device-readahead in GPU_LEASE_READAHEAD (default "0 16": the
#     unlocked slots through staging, then page-locked slots 16 units ahead), and the
#     [REFT] snapshot lines (bytes, ms);
#  3. several ranks sharing the GPU (tools/gpu_multirank.py: lost nodes under ARC and
#     AEC with AOR's device owners, a crash; compared with the failure-free run);
#  4. tools/gpu_smoke.sh (failure-free run, crash + REFT-load + bit-identical final
#     state, iteration times) with fewer iterations than its default;
#
# each step under its own time limit, so one that hangs cannot take the others with it.
# Logs and the smoke table go to $OUT (default runs/gpu-lease); a summary is printed last.
#
#     tools/gpu_lease.sh                 # OUT=..., GPU_LEASE_ITERS (100), PYTHON (python3)
#
# Wheels for the device's Python (3.12 here, manylinux x86-64), fetched where pip works:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-lease}
ITERS=${GPU_LEASE_ITERS:-100}
# a fresh private directory (mktemp: 0700, never one another user could have made first):
# what lands there is imported
SITE=${GPU_LEASE_SITE:-$(mktemp -d -t reft-gpu-site.XXXXXX)}
mkdir -p "$OUT"
T0=$(date +%s)
SUMMARY=()
step() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
note() { SUMMARY+=("$1"); echo "-- $1"; }
# bounded LIMIT LOG CMD...: runs CMD with its output in LOG, killed after LIMIT seconds
bounded() {
    local limit=$1 log=$2; shift 2
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "(killed after $limit s)" >>"$log"
    return $rc
}

# ---- several ranks on one GPU (issue 51; GPU_LEASE_MULTIRANK=0 skips it) ----------------
# tools/gpu_multirank.py: 2 nodes x 2 ranks sharing the GPU over gloo (device tensors,
# megatron/training/gloo_device.py stages what gloo cannot do on them), TP2 x DP2 ZeRO-1:
# a failure-free reference, a lost node under arc,aor and under aec,aor (REFT-load's H2D
# of peers' slices, AOR's device owners), a crash; each final checkpoint compared with
# the reference by tools/compare_checkpoints.py. Its table goes to $OUT/multirank.
# GPU_LEASE_DRY_RUN=1: only this step's trainer commands, printed (tests parse them).
multi_rank_step() {
    local dir=$OUT/multirank
    if [[ ${GPU_LEASE_DRY_RUN:-0} == 1 ]]; then
        "$PY" tools/gpu_multirank.py --dry-run --out "$dir"
        return
    fi
    [[ ${GPU_LEASE_MULTIRANK:-1} == 0 ]] && return
    step "several ranks on one GPU (tools/gpu_multirank.py)"
    rm -rf /dev/shm/reft-* "$dir" 2>/dev/null
    bounded 240 "$OUT/multirank.log" "$PY" tools/gpu_multirank.py --out "$dir" --timeout 90
    note "several ranks on one GPU: exit $? ($(grep -c 'identical' "$dir/table.md" 2>/dev/null) of 3 identical; multirank.log, multirank/table.md)"
    cat "$dir/table.md" 2>/dev/null
}
if [[ ${GPU_LEASE_DRY_RUN:-0} == 1 ]]; then
    [[ -z ${GPU_LEASE_SITE:-} ]] && rmdir "$SITE" 2>/dev/null
    multi_rank_step
    exit 0
fi

step "machine"
{ nvidia-smi -L; nvcc --version | tail -2; "$PY" -c 'import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
} 2>&1 | tee "$OUT/machine.txt"

if compgen -G ".whl/*.whl" >/dev/null; then
    step "wheels from .whl/ to $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || note "wheel install FAILED"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# the repository itself, as an editable install would put it (megatron/ is a namespace
# package shared with megatron-core's wheel, so both directories are searched)
export PYTHONPATH="$REPO:$PYTHONPATH"

step "native extension, built in place for this torch"
rm -f reft_ext/_C.*.so reft_ext/_groups.*.so
# one architecture: the device's own (compiling for two doubles nvcc's time)
ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
if TORCH_CUDA_ARCH_LIST=${ARCH:-9.0} bounded 200 "$OUT/build.log" "$PY" setup.py build_ext --inplace -j 4; then
    note "build: $(grep -o 'built reft_ext._C.*' "$OUT/build.log" | head -1)"
else
    note "build FAILED (build.log)"
fi
note "native: $("$PY" -c 'import reft_ext._native as n; print(n.info())' 2>&1 | tail -1)"

step "CUDA tests"
bounded 150 "$OUT/gpu_tests.log" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/unit/test_csrc_copy.py tests/unit/test_csrc_xor.py tests/unit/test_csrc_shm.py \
    tests/gpu tests/unit/test_gpu_trainer_path.py tests/unit/test_aor_gpu_path.py
note "CUDA tests: $(grep -E '(passed|failed|error)' "$OUT/gpu_tests.log" | tail -1)"

MODEL=${GPU_LEASE_MODEL:-llama2-1.3b}
if [ "$MODEL" != none ]; then
    step "$MODEL: no snapshot, then a snapshot every iteration"
    BIG=(--model-size "$MODEL" --seq-length 2048 --mock-data --tokenizer-type NullTokenizer
         --vocab-size 32000 --micro-batch-size 2 --global-batch-size 8 --train-iters 12
         --lr 1e-4 --lr-warmup-iters 2 --log-interval 1 --eval-interval 1000 --eval-iters 0
         --bf16 --use-distributed-optimizer --reft-ranks-per-node 1 ${GPU_LEASE_MODEL_ARGS:-})
    # no snapshot, then one every iteration for each --reft-device-readahead in
    # GPU_LEASE_READAHEAD (0: the unlocked slots and staging of before, the baseline)
    for run in snap0 ${GPU_LEASE_READAHEAD:-0 16}; do
        rm -rf /dev/shm/reft-* 2>/dev/null
        if [ "$run" = snap0 ]; then extra=(--reft-snapshot-every 0); log=big_snap0
        else extra=(--reft-snapshot-every 1 --reft-device-readahead "$run"); log=big_ra$run; fi
        bounded 150 "$OUT/$log.log" "$PY" -m torch.distributed.run --standalone \
            --nproc-per-node 1 pretrain_llama.py "${BIG[@]}" "${extra[@]}" --reft-schedule has
        # median iteration time after the first four (warm-up, first snapshots)
        med=$(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$OUT/$log.log" |
              awk -F': ' 'NR > 4 { print $2 }' | sort -n | awk '{ a[NR] = $1 } END {
              if (NR) print a[int((NR + 1) / 2)]; else print "n/a" }')
        note "$MODEL ${extra[*]}: median iteration $med ms"
        grep -h '\[REFT\] snapshot' "$OUT/$log.log" | tail -3
    done
fi

multi_rank_step  # after the save-speed steps, before the smoke

step "tools/gpu_smoke.sh, $ITERS iterations"
rm -rf /dev/shm/reft-* 2>/dev/null
PYTHON="$PY" GPU_SMOKE_ITERS="$ITERS" GPU_SMOKE_FAULT_ITER=$((ITERS / 2)) \
    GPU_SMOKE_DIR=runs/gpu-smoke bounded 330 "$OUT/smoke.log" tools/gpu_smoke.sh "$OUT/table.md"
note "smoke exit $? (table.md, smoke.log)"
tar -czf "$OUT/smoke_logs.tgz" runs/gpu-smoke/*.log 2>/dev/null

step "done"
cat "$OUT/table.md" 2>/dev/null || tail -30 "$OUT/smoke.log"
printf '%s\n' "${SUMMARY[@]}"
grep -E 'FAILED|Error|error' "$OUT/gpu_tests.log" | head -20
