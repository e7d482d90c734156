#!/usr/bin/env bash
# One node's part of a REFT training job, started once per node by srun (reft_job.sh):
#
#   launch_node.sh [TRAINER ARGS...]   this node's torchrun agent; returns its exit status
#                                      after REFT's node watcher is done
#   launch_node.sh --cleanup           remove the job's REFT shared memory on this node
#
# Reads the job-wide settings that reft_job_setup exported (REPO, RDZV_HOST, RDZV_PORT,
# NNODES_MIN, NNODES_MAX, NPROC_PER_NODE, MAX_RESTARTS, LOG_DIR, PYTHON, RDZV_CONF) and
# Slurm's per-task variables (SLURM_JOB_ID, SLURM_NODEID, SLURMD_NODENAME).
#
# Ranks: with the dynamic rendezvous torchrun ignores --node-rank. Agents are ordered by
# (address, pid), so a node's ranks follow its --local-addr (its Slurm node name), and
# REFT's failure domain of a rank is rank // NPROC_PER_NODE (--reft-ranks-per-node
# defaults to torchrun's LOCAL_WORLD_SIZE = NPROC_PER_NODE).
set -uo pipefail  # no -e: torchrun's status is collected, and the watcher waited for

: "${SLURM_JOB_ID:?launch_node.sh runs as a Slurm task (srun) inside a job}"
# REFT's job id (reft_job.sh: the Slurm job's with a secret nonce), from the environment:
# it names /dev/shm/reft-<job> and is given to torchrun as PET_RDZV_ID, not --rdzv-id
job=${REFT_JOB_ID:-$SLURM_JOB_ID}
node_id=${SLURM_NODEID:?launch_node.sh runs as a Slurm task (srun)}
node_name=${SLURMD_NODENAME:-$(hostname -s)}
python=${PYTHON:-python}
shm_dir=${REFT_SHM_DIR:-/dev/shm}  # = --reft-shm-dir
say() { echo "[launch] node $node_id ($node_name): $*"; }

# REFT's watcher (reft_ext/cluster/watcher.py) copies the node's committed snapshots to
# --reft-flush-dir after a worker died (a crash, a hang, preemption). It runs in its own
# session but inside this job step: once this task exits, Slurm kills what is left of the
# step, a watcher in the middle of its flush included. So the task waits for it.
wait_for_watchers() {
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$shm_dir" "$job" \
        "${WATCHER_WAIT_S:-600}" <<'EOF' || say "a REFT watcher was still running; its flush may be incomplete"
import sys
from reft_ext.cluster import status
sys.exit(0 if status.wait_watchers(sys.argv[1], sys.argv[2], float(sys.argv[3])) else 1)
EOF
}

if [[ ${1:-} == --cleanup ]]; then
    # On a cluster everything of the job in this host's /dev/shm is this host's: the
    # node directories it held under any rank numbering, status files, handover notes.
    wait_for_watchers
    shopt -s nullglob
    left=("$shm_dir"/reft-"$job")  # the job's private parent: its nodes' directories
    if (( ${#left[@]} )); then
        rm -rf -- "${left[@]}"
        say "removed ${#left[@]} REFT shared-memory entries of job $job from $shm_dir"
    fi
    exit 0
fi

: "${REPO:?}" "${RDZV_HOST:?}" "${RDZV_PORT:?}" "${NNODES_MIN:?}" "${NNODES_MAX:?}"
: "${NPROC_PER_NODE:?}" "${MAX_RESTARTS:?}" "${LOG_DIR:?}"

if [[ ${RESTART:-torchrun} == in-process ]]; then
    # the in-process node agent: this node's warm workers (its ranks, plus SPARE_WORKERS
    # for a crash on a training node; a spare node's stand by for a lost node's ranks)
    workers=$NPROC_PER_NODE
    (( node_id < NNODES_MAX )) && workers=$(( NPROC_PER_NODE + ${SPARE_WORKERS:-1} ))
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    cmd=("$python" -m reft_ext.cluster.node_agent --store "$RDZV_HOST:$RDZV_PORT"
         --node "$node_id" --host "$node_name" --workers "$workers"
         --world-size $(( NNODES_MAX * NPROC_PER_NODE )) --ranks-per-node "$NPROC_PER_NODE"
         -- "$REPO/pretrain_llama.py" "$@")  # --job-id: REFT_JOB_ID in the environment
    what="node agent"
    launcher="in-process node agent: $workers warm worker(s), $NPROC_PER_NODE ranks per node"
else
# is_host=false: every agent is a client of the store that reft_job.sh runs on the batch
# host (an agent must never host it, or its death would end the rendezvous). The reft
# backend: torch's dynamic rendezvous with the state sealed by REFT_RDZV_SECRET (which
# reft_job.sh exports) and never unpickled unless sealed (reft_ext/cluster/rendezvous.py).
rdzv_conf="is_host=false${RDZV_CONF:+,$RDZV_CONF}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# = torchrun's --rdzv-id = TORCHELASTIC_RUN_ID = REFT's job id (names /dev/shm/reft-<job>),
# in the environment: a command line is every user's to read
export PET_RDZV_ID=$job
cmd=("$python" -m reft_ext.cluster.torchrun
     --nnodes="$NNODES_MIN:$NNODES_MAX"
     --nproc-per-node="$NPROC_PER_NODE"
     --rdzv-backend=reft
     --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"
     --rdzv-conf="$rdzv_conf"
     --max-restarts="$MAX_RESTARTS"
     --local-addr="$node_name"  # resolvable like RDZV_HOST; rank 0's is its workers' MASTER_ADDR
     "$REPO/pretrain_llama.py" "$@")
what=torchrun
launcher="torchrun agent: nnodes $NNODES_MIN:$NNODES_MAX, $NPROC_PER_NODE ranks, rendezvous"
launcher+=" $RDZV_HOST:$RDZV_PORT, restarts $MAX_RESTARTS"
fi

if [[ ${DRY_RUN:-0} == 1 ]]; then
    n_launcher=$(( ${#cmd[@]} - $# ))  # python -m reft_ext.cluster.torchrun ... script
    printf '[launch] dry run: %s:' "${what// /_}"
    printf ' %q' "${cmd[@]:0:n_launcher}"; echo
    printf '[launch] dry run: trainer:'; printf ' %q' "$@"; echo
    # the communication settings the workers inherit (what the trainer judges them by)
    printf '[launch] dry run: env:'
    while IFS= read -r kv; do printf ' %q' "$kv"; done < <(env | LC_ALL=C sort |
        grep -E '^(TORCH_NCCL_|NCCL_|CUDA_DEVICE_MAX_CONNECTIONS=|GLOO_SOCKET_IFNAME=|OMP_NUM_THREADS=)')
    echo
    exit 0
fi

mkdir -p "$LOG_DIR"
node_log=$LOG_DIR/node$node_id-$node_name.log
# MIOpen (ROCm) keeps a SQLite database of tuned kernels: on a shared filesystem hundreds
# of ranks lock it against each other, so env.sh asks for a node-local one, made here on
# every node (the batch script runs on the first node only): mktemp -d, 0700 and of an
# unpredictable name in node-local /tmp, never a fixed name another user could make first
# (whoever owns MIOpen's cache chooses the kernels the job runs). Removed when this ends.
miopen_tmp=""
if [[ ${REFT_MIOPEN_NODE_CACHE:-0} == 1 && -z ${MIOPEN_USER_DB_PATH:-} ]]; then
    miopen_tmp=$(mktemp -d "${TMPDIR:-/tmp}/miopen-$job-XXXXXXXX") ||
        { say "cannot make a private MIOpen cache in ${TMPDIR:-/tmp}"; exit 1; }
    export MIOPEN_USER_DB_PATH=$miopen_tmp MIOPEN_CUSTOM_CACHE_DIR=$miopen_tmp
fi
for d in "${MIOPEN_USER_DB_PATH:-}" "${MIOPEN_CUSTOM_CACHE_DIR:-}"; do
    [[ -z $d ]] && continue
    mkdir -p -m 700 "$d"
    # one the user named: theirs, not a link, not writable by others, or not used
    if [[ -L $d || ! -O $d ]] || [[ -n $(find "$d" -maxdepth 0 -perm /022) ]]; then
        say "MIOpen cache $d is a link, another user's or writable by others: set" \
            "MIOPEN_USER_DB_PATH to a directory of your own"
        exit 1
    fi
done

say "$launcher; log $node_log"
# Everything the agent and its workers print goes to this node's log and to srun (the
# job's .out, labelled by task). tee ignores SIGTERM: at a time limit it must keep
# carrying torchrun's shutdown and REFT's flush lines instead of breaking the pipe.
"${cmd[@]}" > >(trap '' TERM; exec tee -a "$node_log") 2>&1 &
agent=$!
# Slurm signals the task at a time limit (--signal, then SIGTERM and SIGKILL after
# KillWait). torchrun turns SIGTERM into a shutdown of its workers, and REFT's watcher
# flushes; this shell must pass it on and stay alive until both are done.
# shellcheck disable=SC2317  # called by the trap
forward() {
    say "SIGTERM: passing it to torchrun (pid $agent); REFT's watcher flushes the snapshots"
    kill -TERM "$agent" 2>/dev/null
}
trap forward TERM
rc=0
wait "$agent" || rc=$?
while kill -0 "$agent" 2>/dev/null; do  # wait returns early when the trap ran
    rc=0
    wait "$agent" || rc=$?
done
trap - TERM
[[ -n $miopen_tmp ]] && rm -rf -- "$miopen_tmp"  # this node's private MIOpen cache
wait_for_watchers
say "$what exited with status $rc"
exit "$rc"
