#!/bin/bash
# One command that proves REFT's GPU path on a machine with one (or more) CUDA GPUs:
#
#     tools/gpu_smoke.sh [TABLE_FILE]        # TABLE_FILE or $GPU_SMOKE_OUT, default
#                                            # $GPU_SMOKE_DIR/table.md
#
#  1. the native kernels' parity tests (csrc copy engine, XOR, pinned shm) on the GPU;
#  2. a failure-free run: the tiny Llama for $GPU_SMOKE_ITERS iterations on every local GPU,
#     the TE layer spec (--transformer-impl transformer_engine when TransformerEngine is
#     importable, else local), megatron-core's FusedAdam when TE/apex provide it, bf16,
#     a REFT snapshot every iteration (--reft-schedule has);
#  3. the same run with a crash of rank 0 at iteration 150 (torchrun --max-restarts 1):
#     REFT-load from host memory, its downtime ("[REFT] recovery: ... in X ms"), and the
#     final checkpoint compared bit for bit with run 2's (tools/compare_checkpoints.py);
#  4. iteration time without snapshots and with --reft-schedule end-of-iteration, beside
#     run 2's HAS;
# then prints a table and writes it to the table file.  Exit 0 when every check holds,
# 1 when one fails, 2 when there is no CUDA device (nothing is run).
#
# GPU_SMOKE_DRY_RUN=1 prints every command it would run (shell-quoted, "+ " first) and
# runs none: tests/unit/test_gpu_smoke_script.py parses them with the trainer's parser.
# Other knobs: GPU_SMOKE_ITERS (300), GPU_SMOKE_FAULT_ITER (150), GPU_SMOKE_DIR
# (runs/gpu-smoke), GPU_SMOKE_NPROC (all local GPUs), GPU_SMOKE_IMPL (auto|transformer_engine|local),
# PYTHON (.venv/bin/python when present).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DRY=${GPU_SMOKE_DRY_RUN:-0}
ITERS=${GPU_SMOKE_ITERS:-300}
FAULT_ITER=${GPU_SMOKE_FAULT_ITER:-150}
DIR=${GPU_SMOKE_DIR:-runs/gpu-smoke}
OUT=${1:-${GPU_SMOKE_OUT:-$DIR/table.md}}

die() { echo "gpu_smoke: $1" >&2; exit "${2:-1}"; }
# Prints the command shell-quoted (so it can be parsed back), then runs it unless dry.
run() {
    local log=$1; shift
    printf '+'; printf ' %q' "$@"; printf ' > %q\n' "$log"
    [ "$DRY" = 1 ] && return 0
    "$@" >"$log" 2>&1
}
# python one-liners that answer a question about this machine (run in dry mode too)
ask() { "$PY" -c "$1" 2>/dev/null; }

# GPU_SMOKE_CPU=1 rehearses the script itself on CPU (gloo, no CUDA check): a test of
# this script on a CPU machine, never a proof of the GPU path.
CPU=${GPU_SMOKE_CPU:-0}
BACKEND=nccl
if [ "$CPU" = 1 ]; then
    NGPU=1; BACKEND=gloo
elif [ "$DRY" != 1 ]; then
    # one interpreter start: importing torch takes seconds on a loaded machine
    read -r NGPU TORCH_V < <(ask 'import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__)')
    [ "${NGPU:-0}" -ge 1 ] || die "no CUDA device: torch.cuda.is_available() is False with $PY \
(torch ${TORCH_V:-not importable}). This script proves the GPU path and \
needs a CUDA GPU and a CUDA build of torch; the CPU path is proven by 'make test'." 2
else
    NGPU=1
fi
NPROC=${GPU_SMOKE_NPROC:-$NGPU}
IMPL=${GPU_SMOKE_IMPL:-auto}
if [ "$IMPL" = auto ]; then
    IMPL=$(ask 'import transformer_engine.pytorch; print("transformer_engine")' || echo local)
fi
if [ "$DRY" != 1 ]; then  # for the table (megatron-core picks FusedAdam when it imports)
    FUSED=$(ask 'from transformer_engine.pytorch.optimizers import FusedAdam; print("TE FusedAdam")' ||
            ask 'from apex.optimizers import FusedAdam; print("apex FusedAdam")' ||
            echo "torch Adam (no TE/apex)")
    NATIVE=$(ask 'import reft_ext._native as n; i = n.info()
print("native=%s cuda=%s" % (i["native"], i.get("cuda")))' || echo "reft_ext not importable")
fi
# fresh checkpoint directories: a stale final checkpoint would make the comparison moot
[ "$DRY" = 1 ] || { rm -rf "$DIR/ref" "$DIR/crash"; mkdir -p "$DIR"; }

# The tiny model on every local GPU: DP over the GPUs, snapshots every iteration. ZeRO-1
# (--use-distributed-optimizer), as `make run`: bf16 with megatron-core's plain
# Float16Optimizer fails its final dist-checkpoint save here ("Param id N does not match
# any model sharded param"), a trainer problem this script is not the place to hide.
COMMON=(--model-size tiny --micro-batch-size 4 --global-batch-size $((4 * NPROC))
        --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters $(( ITERS / 5 < 20 ? ITERS / 5 : 20 ))
        --lr-decay-style cosine --log-interval 10 --eval-interval "$ITERS" --eval-iters 2
        --bf16 --use-distributed-optimizer --transformer-impl "$IMPL"
        --distributed-backend "$BACKEND"
        --reft-ranks-per-node "$NPROC" --log-params-hash)
train() {  # train LOG MAX_RESTARTS TRAINER_ARGS...
    local log=$1 restarts=$2; shift 2
    run "$log" "$PY" -m reft_ext.cluster.torchrun --standalone --nproc-per-node "$NPROC" \
        --max-restarts "$restarts" pretrain_llama.py "${COMMON[@]}" "$@"
}
FAILED=()
check() { "$@" || FAILED+=("$CHECK"); }

echo "== 1. kernel parity (csrc copy engine, XOR, pinned shm) on the GPU"
CHECK="kernel parity tests"
check run "$DIR/parity.log" "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_csrc_copy.py tests/unit/test_csrc_xor.py tests/unit/test_csrc_shm.py

echo "== 2. failure-free run: $ITERS iterations, $IMPL spec, bf16, snapshot every iteration (HAS)"
CHECK="failure-free run"
check train "$DIR/ref.log" 0 --reft-snapshot-every 1 --reft-schedule has \
    --save "$DIR/ref/checkpoints"

echo "== 3. crash of rank 0 at iteration $FAULT_ITER, REFT-load, bit-identical final state"
CHECK="crash run"
check train "$DIR/crash.log" 1 --reft-snapshot-every 1 --reft-schedule has \
    --inject-fault "0:$FAULT_ITER" --save "$DIR/crash/checkpoints"
CHECK="final state bit-identical"
check run "$DIR/compare.log" "$PY" tools/compare_checkpoints.py \
    "$DIR/ref/checkpoints" "$DIR/crash/checkpoints"

echo "== 4. iteration time: no snapshot, end-of-iteration"
CHECK="no-snapshot run"
check train "$DIR/nosnap.log" 0 --reft-snapshot-every 0
CHECK="end-of-iteration run"
check train "$DIR/eoi.log" 0 --reft-snapshot-every 1 --reft-schedule end-of-iteration

[ "$DRY" = 1 ] && { echo "(dry run: nothing was run; the table would go to $OUT)"; exit 0; }

# mean of the "elapsed time per iteration (ms)" lines after the first (warm-up) one
iter_ms() {
    grep -o 'elapsed time per iteration (ms): [0-9.]*' "$1" 2>/dev/null | awk -F': ' \
        'NR > 1 { s += $2; n++ } END { if (n) printf "%.1f", s / n; else print "n/a" }'
}
downtime=$(grep -o '\[REFT\] recovery: .* in [0-9.]* ms' "$DIR/crash.log" | tail -1 |
           sed 's/.* in \([0-9.]*\) ms/\1/')
recovered_from=$(grep -o '\[REFT\] recovery: .* in [0-9.]* ms' "$DIR/crash.log" | tail -1 |
                 sed 's/.* from \(.*\) in [0-9.]* ms/\1/')
if [ "$CPU" != 1 ]; then  # on a GPU the native CUDA kernels must be what was tested
    [[ "$NATIVE" == *"cuda=True"* ]] || FAILED+=("reft_ext._C has no CUDA part ($NATIVE): \
pip install -v --no-build-isolation -e . shows the [reft_ext] reason")
    ! grep -qi 'SKIPPED.*cuda' "$DIR/parity.log" || FAILED+=("CUDA parity tests skipped on a GPU")
fi
[ -n "$downtime" ] || FAILED+=("no '[REFT] recovery' line in $DIR/crash.log (REFT-load did not run)")
verdict=$(if [[ " ${FAILED[*]} " == *"bit-identical"* ]]; then echo "DIFFERS ($DIR/compare.log)"
          else echo "bit-identical"; fi)
parity=$(tail -1 "$DIR/parity.log")
has=$(iter_ms "$DIR/ref.log"); none=$(iter_ms "$DIR/nosnap.log"); eoi=$(iter_ms "$DIR/eoi.log")
gpu=$(ask 'import torch; print(torch.cuda.get_device_name(0))' || echo "CPU (GPU_SMOKE_CPU=1 rehearsal, not a GPU proof)")

{
    echo "## tools/gpu_smoke.sh, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "$NPROC x $gpu; torch $(ask 'import torch; print(torch.__version__)'); layer spec $IMPL;"
    echo "optimizer $FUSED; reft_ext $NATIVE; tiny Llama, bf16, $ITERS iterations."
    echo
    echo "| check | result |"
    echo "|---|---|"
    echo "| kernel parity (csrc copy, XOR, shm) | $parity |"
    echo "| crash at iteration $FAULT_ITER: REFT-load downtime | ${downtime:-none} ms (from ${recovered_from:-?}) |"
    echo "| final state vs failure-free run (compare_checkpoints) | $verdict |"
    echo "| iteration time, no snapshot | $none ms |"
    echo "| iteration time, snapshot every iteration, --reft-schedule has | $has ms |"
    echo "| iteration time, snapshot every iteration, --reft-schedule end-of-iteration | $eoi ms |"
    echo
    if [ ${#FAILED[@]} -eq 0 ]; then echo "All checks passed."
    else printf 'FAILED: %s\n' "${FAILED[@]}"; echo "Logs: $DIR/*.log"; fi
} | tee "$OUT"
echo "table written to $OUT"
[ ${#FAILED[@]} -eq 0 ]
