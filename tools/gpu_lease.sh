#!/bin/bash
# The GPU checks on a bare CUDA machine that has torch but none of this project's other
# dependencies (a lent device with no package registry): wheels carried in .whl/
# (megatron-core for that machine's Python) are installed to a private directory, then,
# in one call of at most GPU_LEASE_BUDGET seconds (default 470: under 8 minutes on a
# 16-core H100), correctness first, then performance:
#
#  correctness (each step under its own limit; its row noted when it ends)
#  1. the native extension, built in place for this torch and CUDA;
#  2. the CUDA tests (kernel parity, device staging, the trainer's GPU path, AOR's D2H;
#     GPU_LEASE_TESTS=0 skips them);
#  3. tools/gpu_smoke.sh with GPU_LEASE_ITERS iterations (default 30): a failure-free
#     run, a crash + REFT-load, the final states compared bit for bit;
#  4. several ranks sharing the GPU (GPU_LEASE_MULTIRANK=0 skips it): the staged
#     collectives against plain gloo on host tensors (a reference that shares no
#     staging), then tools/gpu_multirank.py's cases, each row written as it finishes;
#
#  performance (what the budget has left; a line says what was skipped)
#  5. the copy-and-hash pipeline (tools/gpu_pipeline_check.py): native digests equal
#     chunk_digest of the slot bytes for 1 GiB of random bf16 and fp32 device tensors
#     with an odd tail; the ordering test; the pipeline's GB/s at N = 1, 2, 4, 8;
#  6. a paper-size model on the one GPU (GPU_LEASE_MODEL, default llama2-1.3b; "none"
#     skips it): no snapshot, then a snapshot every iteration (HAS, page-locked slots)
#     at each N of GPU_LEASE_THREADS (default "2 4", REFT_COPY_THREADS); median
#     iteration times and the [REFT] lines.
#
# Each step runs under its own time limit, cut to what is left of the budget, so one
# that hangs cannot take the others with it. Logs and tables go to $OUT (default
# runs/gpu-lease); a summary last. Record its tables, dated, in docs/gpu.md.
#
#     tools/gpu_lease.sh                 # OUT=..., PYTHON (python3)
#
# GPU_LEASE_DRY_RUN=1 prints every step ("== correctness: ..." / "== performance: ...")
# and its commands ("+ " first, shell-quoted) and runs none: tests/unit/
# test_gpu_lease_script.py parses the trainer commands with the trainer's own parser.
#
# Wheels for the device's Python (3.12 here, manylinux x86-64), fetched where pip works:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-lease}
ITERS=${GPU_LEASE_ITERS:-30}
BUDGET=${GPU_LEASE_BUDGET:-470}
DRY=${GPU_LEASE_DRY_RUN:-0}
mkdir -p "$OUT"
T0=$(date +%s)
SUMMARY=()
step() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }  # "correctness: ..." / "performance: ..."
note() { [[ $DRY == 1 ]] || { SUMMARY+=("$1"); echo "-- $1"; }; }
# bounded LIMIT LOG CMD...: runs CMD with its output in LOG, killed after LIMIT seconds or
# when the budget is spent, whichever comes first; a dry run prints it ("+ " first)
bounded() {
    local limit=$1 log=$2; shift 2
    if [[ $DRY == 1 ]]; then printf '+'; printf ' %q' "$@"; printf ' > %q\n' "$log"; return 0; fi
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    (( left < limit )) && limit=$left
    if (( limit < 10 )); then echo "(not run: the budget of $BUDGET s is spent)" >"$log"; return 124; fi
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "(killed after $limit s)" >>"$log"
    return $rc
}
SMOKE_LIMIT=150
# fits NAME LIMIT: whether LIMIT seconds of the budget are left; says so when not
fits() {
    [[ $DRY == 1 ]] && return 0
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    (( left >= $2 )) && return 0
    note "$1: skipped ($left s of the budget left, it takes up to $2 s)"
    return 1
}
# median iteration time of a trainer log after the first SKIP iterations (warm-up)
median_ms() {
    grep -o 'elapsed time per iteration (ms): [0-9.]*' "$1" | awk -F': ' -v skip="$2" \
        'NR > skip { print $2 }' | sort -n | awk '{ a[NR] = $1 } END {
        if (NR) print a[int((NR + 1) / 2)]; else print "n/a" }'
}

# ---- several ranks on one GPU (issue 51; GPU_LEASE_MULTIRANK=0 skips it) -----------------
# tools/gpu_multirank.py: first --staging-check (two gloo ranks, each staged collective on
# device tensors vs plain gloo on host copies: a reference that shares no staging), then
# 2 nodes x 2 ranks sharing the GPU over gloo (megatron/training/gloo_device.py stages
# what gloo cannot do on device tensors), TP2 x DP2 ZeRO-1: a failure-free reference, a
# lost node under arc,aor and under aec,aor (REFT-load's H2D of peers' slices, AOR's
# device owners), a crash; each final checkpoint compared with the reference by
# tools/compare_checkpoints.py, its row written to $OUT/multirank/table.md as it ends.
multi_rank_step() {
    local dir=$OUT/multirank
    if [[ $DRY == 1 ]]; then
        step "correctness: several ranks on one GPU (tools/gpu_multirank.py)"
        "$PY" tools/gpu_multirank.py --staging-check --dry-run --out "$dir"
        "$PY" tools/gpu_multirank.py --dry-run --out "$dir"
        return
    fi
    [[ ${GPU_LEASE_MULTIRANK:-1} == 1 ]] || return
    step "correctness: several ranks on one GPU (tools/gpu_multirank.py)"
    rm -rf /dev/shm/reft-* "$dir" 2>/dev/null
    bounded 60 "$OUT/staging.log" "$PY" tools/gpu_multirank.py --staging-check --out "$dir"
    note "staged collectives vs plain gloo on host: exit $? ($(grep -c 'identical to plain' "$OUT/staging.log" 2>/dev/null) of 10 identical; staging.log)"
    bounded 240 "$OUT/multirank.log" "$PY" tools/gpu_multirank.py --out "$dir" --timeout 90
    note "several ranks on one GPU: exit $? ($(grep -c 'identical' "$dir/table.md" 2>/dev/null) of 3 identical; multirank.log, multirank/table.md)"
    cat "$dir/table.md" 2>/dev/null
}

if [[ $DRY != 1 ]]; then
    step "machine"
    { nvidia-smi -L; nvcc --version | tail -2; "$PY" -c 'import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    } 2>&1 | tee "$OUT/machine.txt"
    # a fresh private directory (mktemp: 0700, never one another user could have made
    # first): what lands there is imported
    SITE=${GPU_LEASE_SITE:-$(mktemp -d -t reft-gpu-site.XXXXXX)}
    if compgen -G ".whl/*.whl" >/dev/null; then
        step "wheels from .whl/ to $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || note "wheel install FAILED"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
# the repository itself, as an editable install would put it (megatron/ is a namespace
# package shared with megatron-core's wheel, so both directories are searched)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

step "correctness: native extension, built in place for this torch"
[[ $DRY == 1 ]] || rm -f reft_ext/_C.*.so reft_ext/_groups.*.so
# one architecture: the device's own (compiling for two doubles nvcc's time)
ARCH=$([[ $DRY == 1 ]] || "$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
if bounded 150 "$OUT/build.log" env TORCH_CUDA_ARCH_LIST="${ARCH:-9.0}" "$PY" setup.py build_ext --inplace -j 4; then
    note "build: $(grep -o 'built reft_ext._C.*' "$OUT/build.log" 2>/dev/null | head -1)"
else
    note "build FAILED (build.log)"
fi
[[ $DRY == 1 ]] || note "native: $("$PY" -c 'import reft_ext._native as n; print(n.info())' 2>&1 | tail -1)"

if [[ ${GPU_LEASE_TESTS:-1} == 1 ]]; then
    step "correctness: CUDA tests"
    bounded 120 "$OUT/gpu_tests.log" "$PY" -m pytest -q -rs -p no:cacheprovider \
        tests/unit/test_csrc_copy.py tests/unit/test_csrc_xor.py tests/unit/test_csrc_shm.py \
        tests/gpu tests/unit/test_gpu_trainer_path.py tests/unit/test_aor_gpu_path.py
    note "CUDA tests: $(grep -E '(passed|failed|error)' "$OUT/gpu_tests.log" 2>/dev/null | tail -1)"
fi

step "correctness: tools/gpu_smoke.sh, $ITERS iterations (a crash at $((ITERS / 2)), bit-identical recovery)"
if [[ $DRY == 1 ]]; then
    PYTHON="$PY" GPU_SMOKE_DRY_RUN=1 GPU_SMOKE_ITERS="$ITERS" GPU_SMOKE_FAULT_ITER=$((ITERS / 2)) \
        GPU_SMOKE_DIR=runs/gpu-smoke tools/gpu_smoke.sh "$OUT/table.md"
else
    rm -rf /dev/shm/reft-* 2>/dev/null
    PYTHON="$PY" GPU_SMOKE_ITERS="$ITERS" GPU_SMOKE_FAULT_ITER=$((ITERS / 2)) \
        GPU_SMOKE_DIR=runs/gpu-smoke bounded $SMOKE_LIMIT "$OUT/smoke.log" tools/gpu_smoke.sh "$OUT/table.md"
    note "smoke exit $? (table.md, smoke.log)"
    tar -czf "$OUT/smoke_logs.tgz" runs/gpu-smoke/*.log 2>/dev/null
    cat "$OUT/table.md" 2>/dev/null || tail -30 "$OUT/smoke.log"
fi

multi_rank_step

# ---- performance: what the budget has left --------------------------------------------
if fits "the copy-and-hash pipeline check" 60; then
    step "performance: the copy-and-hash pipeline: digests, ordering, GB/s at N = 1, 2, 4, 8"
    bounded 100 "$OUT/pipeline.log" "$PY" tools/gpu_pipeline_check.py --gib 1 --threads 1,2,4,8
    note "pipeline check: exit $? (pipeline.log)"
    [[ $DRY == 1 ]] || cat "$OUT/pipeline.log"
fi

MODEL=${GPU_LEASE_MODEL:-llama2-1.3b}
if [ "$MODEL" != none ] && fits "$MODEL runs" 90; then
    step "performance: $MODEL: no snapshot, then a snapshot every iteration at N = ${GPU_LEASE_THREADS:-2 4}"
    BIG=(--model-size "$MODEL" --seq-length 2048 --mock-data --tokenizer-type NullTokenizer
         --vocab-size 32000 --micro-batch-size 2 --global-batch-size 8 --train-iters 8
         --lr 1e-4 --lr-warmup-iters 2 --log-interval 1 --eval-interval 1000 --eval-iters 0
         --bf16 --use-distributed-optimizer --reft-ranks-per-node 1 ${GPU_LEASE_MODEL_ARGS:-})
    # no snapshot (the baseline), then one every iteration into page-locked slots
    # (--reft-device-readahead > 0) with the pipeline's N fixed by REFT_COPY_THREADS
    for run in snap0 ${GPU_LEASE_THREADS:-2 4}; do
        [[ $DRY == 1 ]] || rm -rf /dev/shm/reft-* 2>/dev/null
        if [ "$run" = snap0 ]; then extra=(--reft-snapshot-every 0); log=big_snap0
        else extra=(--reft-snapshot-every 1 --reft-device-readahead 16); log=big_n$run; fi
        bounded 110 "$OUT/$log.log" env REFT_COPY_THREADS="${run#snap}" "$PY" -m reft_ext.cluster.torchrun \
            --standalone --nproc-per-node 1 pretrain_llama.py "${BIG[@]}" "${extra[@]}" --reft-schedule has
        [[ $DRY == 1 ]] && continue
        note "$MODEL ${extra[*]} REFT_COPY_THREADS=${run#snap}: median iteration $(median_ms "$OUT/$log.log" 3) ms"
        grep -h '\[REFT\] snapshot' "$OUT/$log.log" | tail -3
    done
fi
[[ $DRY == 1 ]] && exit 0

step "done"
printf '%s\n' "${SUMMARY[@]}"
grep -E 'FAILED|Error|error' "$OUT/gpu_tests.log" "$OUT/staging.log" "$OUT/pipeline.log" 2>/dev/null | head -20
