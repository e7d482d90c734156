# shellcheck shell=bash
# The job-level half of every sbatch script in examples/ (sourced, not run):
#
#   reft_job_setup          the job's shape: training nodes, hot spares, elastic minimum,
#                           rendezvous host and port, log directory (exported for srun)
#   reft_job_run ARGS...    the rendezvous store, one srun task per node running
#                           launch_node.sh (a torchrun agent) with the trainer's ARGS,
#                           the clean-up step, and the job's verdict (its exit status)
#
# The node-level half is launch_node.sh. Knobs, all optional (environment or set in the
# sbatch script before reft_job_setup):
#
#   RESTART        how a failure is survived (default in-process; torchrun for an
#                  elastic job, MIN_NODES < nodes):
#                    in-process  the survivors keep their processes; a dead rank is
#                                replaced by a warm worker of its node, a lost node's
#                                ranks by a spare node's warm workers (one coordinator
#                                in this batch step, one node agent per node:
#                                reft_ext/cluster/coordinator.py, node_agent.py)
#                    torchrun    torchrun's process restart: every rank restarts
#   SPARE_NODES    hot spares among the allocated nodes (default 0): they start agents
#                  (torchrun: waiting in its rendezvous; in-process: warm workers)
#                  that take the ranks of a lost node
#   SPARE_WORKERS  in-process: warm workers per training node for a crashed rank (1)
#   ABORT_TIMEOUT  in-process: seconds a rank may take to leave a failed generation
#                  before its node agent kills it as frozen (30)
#   MIN_NODES      elastic minimum, torchrun --nnodes MIN:MAX (default MAX: fixed size;
#                  RESTART=torchrun only: in-process keeps the job's size)
#   NPROC_PER_NODE ranks per node = devices per node (default 8); one failure domain
#   MAX_RESTARTS   torchrun --max-restarts (default 3)
#   RDZV_HOST      rendezvous host (default: the first node of the allocation, where
#                  Slurm runs the batch script and so this file)
#   RDZV_PORT      rendezvous port (default: one the store binds, port 0, passed on to
#                  the nodes: no port another user can work out and hold first)
#   RDZV_CONF      extra torchrun --rdzv-conf (e.g. keep_alive_interval=5)
#   LOG_DIR        per-node logs (default <submit dir>/logs/<job name>-<job id>)
#   PYTHON         the interpreter with torch (default: python, i.e. the active venv)
#   KEEP_SHM=1     leave the job's /dev/shm segments on the nodes (default: removed)
#   DRY_RUN=1      print the srun, torchrun and trainer command lines, start nothing

_reft_die() {
    echo "[reft_job] error: $*" >&2
    exit 2
}

reft_job_setup() {
    : "${SLURM_JOB_ID:?not inside a Slurm job: submit this script with sbatch}"
    : "${REPO:?set REPO to the repository root (sbatch runs a copy of the script, so its own path says nothing)}"
    [[ -f $REPO/pretrain_llama.py ]] || _reft_die "REPO=$REPO has no pretrain_llama.py"
    PYTHON=${PYTHON:-python}

    # Every node of the allocation, in Slurm's order. The first one runs this batch
    # script; it hosts the rendezvous store (mapfile, not `| head -1`: no SIGPIPE
    # under pipefail on a long node list).
    local -a hosts
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ALLOC_NODES=${#hosts[@]}
    (( ALLOC_NODES >= 1 )) || _reft_die "scontrol found no hosts in '$SLURM_JOB_NODELIST'"

    # Hot spares: allocate N + S nodes, let torchrun form the job from N of them
    # (--nnodes MIN:N). The other agents wait in the rendezvous's redundancy list
    # without disturbing the job, and join the next round when a node is lost.
    SPARE_NODES=${SPARE_NODES:-0}
    NNODES_MAX=$(( ALLOC_NODES - SPARE_NODES ))
    (( NNODES_MAX >= 1 )) || _reft_die "SPARE_NODES=$SPARE_NODES leaves no training node of $ALLOC_NODES"
    NNODES_MIN=${MIN_NODES:-$NNODES_MAX}
    (( NNODES_MIN >= 1 && NNODES_MIN <= NNODES_MAX )) ||
        _reft_die "MIN_NODES=$NNODES_MIN must be 1..$NNODES_MAX"
    # torchrun does not tell its workers MIN; REFT needs it to let a node that fails the
    # health check leave (docs/nodes.md). 0 = not elastic: such a node stops the job.
    REFT_MIN_NODES=$(( NNODES_MIN < NNODES_MAX ? NNODES_MIN : 0 ))

    RDZV_HOST=${RDZV_HOST:-${hosts[0]}}
    # one port per job, chosen by the kernel when the store binds (port 0) and passed on
    # to the nodes: a port worked out from the job id could be held by anyone first
    RDZV_PORT=${RDZV_PORT:-0}
    # REFT's job id: the Slurm job's, with a per-job secret nonce. It names the job's
    # /dev/shm parent on every node (<shm>/reft-<id>, reft_ext/store/paths.py): a name
    # made from the job id alone could be made by another user before the job starts.
    # srun hands it to the tasks in their environment, never on a command line.
    REFT_JOB_ID=${REFT_JOB_ID:-$SLURM_JOB_ID-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(8))')}
    NPROC_PER_NODE=${NPROC_PER_NODE:-8}
    MAX_RESTARTS=${MAX_RESTARTS:-3}
    # in-process where it applies (a job of fixed size), else torchrun's restart
    RESTART=${RESTART:-$( (( NNODES_MIN == NNODES_MAX )) && echo in-process || echo torchrun)}
    SPARE_WORKERS=${SPARE_WORKERS:-1}
    # What each mode needs from NCCL's watchdog, set here (not left to a default): on a
    # failed collective, torchrun's restart wants the process ended (1: abort the
    # communicators and exit, so the agent restarts the workers); the in-process restart
    # keeps the survivors, so the watchdog must not end them (0: the abort watcher and
    # the node agent end a generation; the trainer refuses 1, 3 or unset: torch's
    # default 3 also ends the process)
    case $RESTART in
        in-process)
            (( NNODES_MIN == NNODES_MAX )) || _reft_die "MIN_NODES=$NNODES_MIN: an elastic" \
                "job needs RESTART=torchrun (the in-process restart keeps the job's size;" \
                "SPARE_NODES replace lost nodes)"
            export TORCH_NCCL_ASYNC_ERROR_HANDLING=0 ;;
        torchrun) export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 ;;
        *) _reft_die "RESTART=$RESTART: choose in-process or torchrun" ;;
    esac
    LOG_DIR=${LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/logs/${SLURM_JOB_NAME:-job}-$SLURM_JOB_ID}

    # Each round's rank-0 agent publishes a fresh store for its workers. torch's default
    # (the agents share the first round's store) keeps a dead address on the survivors
    # once the node that hosted it has been replaced by a spare.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # log lines reach the per-node logs when printed, not when a buffer fills: a hung
    # node's last words are what an operator reads first
    export PYTHONUNBUFFERED=1
    export REPO PYTHON ALLOC_NODES SPARE_NODES NNODES_MIN NNODES_MAX REFT_MIN_NODES \
        RDZV_HOST RDZV_PORT NPROC_PER_NODE MAX_RESTARTS LOG_DIR RESTART SPARE_WORKERS \
        REFT_JOB_ID
    echo "[reft_job] job $SLURM_JOB_ID (${SLURM_JOB_NAME:-?}): $ALLOC_NODES node(s) allocated," \
        "training on $NNODES_MIN:$NNODES_MAX x $NPROC_PER_NODE ranks, $SPARE_NODES hot spare(s);" \
        "rendezvous $RDZV_HOST:${RDZV_PORT/#0/(port chosen at bind)}; restart $RESTART;" \
        "max restarts $MAX_RESTARTS;" \
        "logs in $LOG_DIR"
}

# The rendezvous store lives in the batch script, not inside the first node's agent
# (torchrun's default with is_host auto-detection): an agent that dies must not take the
# job's rendezvous with it, or no spare could ever join (tools/launch_nodes.py does the
# same on one host). It runs on the batch host, which Slurm needs alive anyway.
_reft_start_store() {
    local ready=$LOG_DIR/rdzv-store.$SLURM_JOB_ID.ready
    rm -f "$ready"
    "$PYTHON" "$REPO/examples/slurm/rdzv_store.py" --host "$RDZV_HOST" --port "$RDZV_PORT" \
        --ready-file "$ready" \
        >"$LOG_DIR/rdzv-store.log" 2>&1 &
    REFT_STORE_PID=$!
    local waited=0
    until [[ -f $ready ]]; do
        kill -0 "$REFT_STORE_PID" 2>/dev/null ||
            _reft_die "the rendezvous store did not start: $(tail -n 5 "$LOG_DIR/rdzv-store.log")"
        (( waited++ < 1200 )) || _reft_die "the rendezvous store is not ready after 120 s"
        sleep 0.1
    done
    _reft_bound_port "$ready"
}

# The port the store bound (the ready file's last line): what the nodes connect to.
_reft_bound_port() {
    local port
    port=$(tail -n 1 "$1")
    [[ $port =~ ^[0-9]+$ ]] || _reft_die "no port in $1"
    RDZV_PORT=$port
    export RDZV_PORT
    rm -f "$1"
    echo "[reft_job] rendezvous store listening on $RDZV_HOST:$RDZV_PORT"
}

# RESTART=in-process: the coordinator (the in-process supervisor of every node) hosts
# the job's store instead, here for the same reason; its exit status is the job's.
_reft_start_coordinator() {
    local ready=$LOG_DIR/coordinator.$SLURM_JOB_ID.ready
    rm -f "$ready"
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m reft_ext.cluster.coordinator \
        --host "$RDZV_HOST" --port "$RDZV_PORT" --nodes "$NNODES_MAX" \
        --alloc-nodes "$ALLOC_NODES" --ranks-per-node "$NPROC_PER_NODE" \
        --spares-per-node "$SPARE_WORKERS" --max-restarts "$MAX_RESTARTS" \
        --abort-timeout "${ABORT_TIMEOUT:-30}" \
        --log-dir "$LOG_DIR" --ready-file "$ready" \
        -- "$REPO/pretrain_llama.py" "$@" > >(trap '' TERM; exec tee -a "$LOG_DIR/coordinator.log") 2>&1 &
    REFT_STORE_PID=$!
    local waited=0
    until [[ -f $ready ]]; do
        kill -0 "$REFT_STORE_PID" 2>/dev/null ||
            _reft_die "the coordinator did not start: $(tail -n 5 "$LOG_DIR/coordinator.log")"
        (( waited++ < 1200 )) || _reft_die "the coordinator is not listening after 120 s"
        sleep 0.1
    done
    _reft_bound_port "$ready"
}

_reft_stop_store() {
    kill "$REFT_STORE_PID" 2>/dev/null || true
    wait "$REFT_STORE_PID" 2>/dev/null || true
}

# `--save DIR` and `--train-iters N` as the trainer will see them (for the verdict)
_reft_arg() {
    local want=$1 prev=""
    shift
    for a in "$@"; do
        [[ $prev == "$want" ]] && { echo "$a"; return; }
        prev=$a
    done
}

reft_job_run() {
    local launch=$REPO/examples/slurm/launch_node.sh
    # One task per node, whatever the node's device count: the task is torchrun, which
    # starts NPROC_PER_NODE workers itself. --kill-on-bad-exit=0: a node whose agent
    # fails must not take the step down, the other agents re-rendezvous (with a spare).
    # --no-kill: a node that Slurm sees fail does not end the job step either.
    local -a srun_cmd=(srun --nodes="$ALLOC_NODES" --ntasks="$ALLOC_NODES" --ntasks-per-node=1
                       --kill-on-bad-exit=0 --no-kill --label)
    local -a extra=()
    # cluster-specific binding (GPUs and CPUs per task), set by the sbatch script
    [[ -n ${SRUN_ARGS:-} ]] && read -r -a extra <<< "$SRUN_ARGS"
    srun_cmd+=("${extra[@]}")

    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '[reft_job] dry run: srun step:'; printf ' %q' "${srun_cmd[@]}" bash "$launch"
        echo
        # the node-level command exactly as node 0 would build it
        SLURM_NODEID=0 SLURMD_NODENAME=$RDZV_HOST DRY_RUN=1 bash "$launch" "$@"
        return 0
    fi
    mkdir -p "$LOG_DIR"
    local rc=0 crc=0
    if [[ $RESTART == in-process ]]; then
        # the job's secret: every value that steers the job in its store is signed with
        # it; srun hands it to the node agents in their environment, never through a file
        REFT_INPROCESS_SECRET=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
        export REFT_INPROCESS_SECRET
        _reft_start_coordinator "$@"
        "${srun_cmd[@]}" bash "$launch" "$@" || rc=$?
        # srun reports the worst task (a lost node's); the coordinator knows the job's fate
        wait "$REFT_STORE_PID" || crc=$?
        echo "[reft_job] srun exited with $rc, the coordinator with $crc"
        rc=$crc
    else
        # the agents' rendezvous key: they seal the rendezvous state with it and refuse
        # one they did not seal (nothing another client writes is unpickled); srun hands
        # it to them in their environment, never through a file or a command line
        REFT_RDZV_SECRET=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
        export REFT_RDZV_SECRET
        _reft_start_store
        "${srun_cmd[@]}" bash "$launch" "$@" || rc=$?
    fi
    # The nodes' /dev/shm is RAM: snapshots left behind by a failed job would stay on the
    # node after the job. launch_node.sh waited for the REFT watchers (save-on-failure
    # copies are in --reft-flush-dir), so what is left has no further use.
    if [[ ${KEEP_SHM:-0} != 1 ]]; then
        srun --nodes="$ALLOC_NODES" --ntasks="$ALLOC_NODES" --ntasks-per-node=1 \
            --kill-on-bad-exit=0 --label bash "$launch" --cleanup || true
    fi
    [[ $RESTART == in-process ]] || _reft_stop_store

    # The verdict. srun reports the worst task: a node lost on the way (and replaced by
    # a spare) makes it non-zero although training completed. The persistent checkpoint
    # of the last iteration (written at the end of every run with --save) says it did.
    local save iters last=""
    save=$(_reft_arg --save "$@")
    iters=$(_reft_arg --train-iters "$@")
    if [[ -n $save && -f $save/latest_checkpointed_iteration.txt ]]; then
        last=$(<"$save/latest_checkpointed_iteration.txt")
    fi
    if (( rc != 0 )) && [[ -n $iters && $last == "$iters" ]]; then
        echo "[reft_job] srun exited with $rc (a node or task was lost on the way), but the" \
            "persistent checkpoint in $save is of the last iteration $iters: training completed"
        rc=0
    fi
    echo "[reft_job] job $SLURM_JOB_ID: exit $rc (last persistent checkpoint: ${last:-none})"
    return "$rc"
}
