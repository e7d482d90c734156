# Quick start: `make run` (the default 4-rank CPU job) and `make test` (the whole suite).
# Both create .venv on first use. torch is pinned by constraints.txt so pip never
# resolves a newer (CUDA) torch.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

NPROC  ?= 4
RUN_DIR ?= runs/default
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: install run run-inprocess demo demo-nodes test test-all slurm hip-check gpu-smoke chaos bench clean

$(STAMP): setup.py pyproject.toml constraints.txt csrc/setup_ext.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.10"
	$(PY) -m pip install -q --no-build-isolation -e '.[test,hf]'
	$(PY) -c "import reft_ext._native as n; print('[reft_ext] native engine:', n.info())"
	touch $(STAMP)

install: $(STAMP)

# The default job: tiny Llama, TP1 x PP2 x DP2 with the distributed optimizer (ZeRO-1),
# on the shipped public-domain corpus, checkpoints every 100 iterations, and REFT: a
# snapshot of every rank's state in host memory every iteration, protected by ARC
# replicas (parameters) and AOR (the ZeRO-1 optimizer shards), each rank its own
# failure domain ("node"). torchrun may restart the workers 3 times; its agent runs with
# the reft rendezvous (store on 127.0.0.1, no pickle from it: docs/security.md).
JOB_ARGS = --model-size tiny --pipeline-model-parallel-size 2 --use-distributed-optimizer \
	--micro-batch-size 4 --global-batch-size 32 --train-iters 300 \
	--lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
	--log-interval 10 --eval-interval 100 --eval-iters 4 --save-interval 100 \
	--reft-snapshot-every 1 --reft-protect arc,aor --reft-ranks-per-node 1 \
	--log-params-hash

# RUN_DIR made private (or refused when another user's) and the log written through it,
# never through a link; Ctrl-C leaves the log writer running until the job's last line
# (tools/run_log.py). A re-run with the same RUN_DIR resumes from the host memory an
# interrupted run left (its job id is kept in RUN_DIR/checkpoints/reft-job-id).
run: install
	$(PY) tools/run_log.py --mkdir $(RUN_DIR)
	$(PY) -m reft_ext.cluster.torchrun --standalone --nproc-per-node $(NPROC) --max-restarts 3 \
	    pretrain_llama.py $(JOB_ARGS) \
	    --save $(RUN_DIR)/checkpoints --load $(RUN_DIR)/checkpoints \
	    --tensorboard-dir $(RUN_DIR)/tensorboard $(ARGS) 2>&1 | $(PY) tools/run_log.py $(RUN_DIR)/train.log

# The same job under the in-process supervisor: a failed rank is replaced by a warm spare
# and the others restart inside their own processes (docs/nodes.md); every rank's log lines
# show on the terminal prefixed [default<rank>]: (tools/log_follow.py). Try ARGS=--inject-fault 1:150
run-inprocess: install
	mkdir -p $(RUN_DIR)
	$(PY) tools/launch_nodes.py --restart in-process --spares 1 --nnodes $(NPROC) \
	    --nproc-per-node 1 --max-restarts 3 --log-dir $(RUN_DIR)/logs -- \
	    pretrain_llama.py $(JOB_ARGS) --save $(RUN_DIR)/checkpoints --load $(RUN_DIR)/checkpoints \
	    --tensorboard-dir $(RUN_DIR)/tensorboard $(ARGS) 2>&1 | tee $(RUN_DIR)/launcher.log

# The same job from scratch with a crash (rank 1, iteration 150) and a lost node (rank 2
# and its shared memory, iteration 250, on the restarted attempt); prints what happened
# and compares the state hashes, the loss of the same iterations and the final checkpoint
# with a failure-free run of the same flags: the demo's own (runs/demo-reference-<checksum
# of the flags>, made on first use and reused; `make run`'s directory is never read).
DEMO_DIR ?= runs/demo
DEMO_FAULTS ?= 1:150,2:250:KILL:node:1
demo: install
	$(PY) tools/demo.py --run-dir $(DEMO_DIR) --nproc $(NPROC) \
	    --reference-dir $(DEMO_DIR)-reference -- $(JOB_ARGS) --inject-fault $(DEMO_FAULTS) $(ARGS)

# The same job on 2 nodes x 2 ranks (--reft-ranks-per-node 2), each node holding one rank
# of each pipeline stage (--use-tp-pp-dp-mapping): the placement keeps every ARC and AOR
# copy on the other node (docs/reft.md, "Placement"), and node 1 (ranks 2 and 3 with its
# shared memory) is lost at iteration 250 (5/6 of --train-iters: 33 of ARGS="--train-iters
# 40"). Its failure-free run with the same flags (runs/demo-nodes-reference-<checksum>) is
# made first when missing.
NODES_ARGS = --use-tp-pp-dp-mapping --reft-ranks-per-node 2
NODES_ITERS = $(or $(shell echo ' $(ARGS) ' | sed -n 's/.* --train-iters[ =]\([0-9][0-9]*\) .*/\1/p'),300)
NODES_FAULT ?= 2:$(shell echo $$(( $(NODES_ITERS) * 5 / 6 ))):KILL:node
demo-nodes: install
	$(PY) tools/demo.py --run-dir runs/demo-nodes --nproc $(NPROC) \
	    --reference-dir runs/demo-nodes-reference -- \
	    $(JOB_ARGS) $(NODES_ARGS) --inject-fault $(NODES_FAULT) $(ARGS)

# `make test` (CI, ~11 min on 2 cores) covers every capability end to end once;
# `make test-all` adds the other layouts and schemes of the long recovery tests (~16 min).
test: install slurm
	$(PY) -m pytest -q -m "not slow" tests

test-all: install slurm hip-check
	$(PY) -m pytest -q tests

# The real Slurm that tests/integration/test_slurm_real.py starts (munged, slurmctld and
# four slurmd on this host: tools/local_slurm.py): Debian's slurm-wlm and munge, installed
# when absent. Without root or a package source it says why and the tests skip.
slurm:
	@$(PYTHON) tools/local_slurm.py install || echo "slurm: SKIPPED (the real-Slurm tests will skip)"

# The ROCm compile check (Frontier's MI250X, gfx90a) on any machine, no GPU needed: the
# CUDA kernels hipified by torch's hipify and compiled by hipcc (docs/csrc.md). Without
# hipcc it says how to get it and passes; HIP_CHECK_REQUIRED=1 makes that a failure.
HIP_ARCH ?= gfx90a
hip-check: install
	@if command -v hipcc >/dev/null; then \
	    $(PY) -m csrc.setup_ext --hip-check build/hip-check $(HIP_ARCH); \
	elif [ "$(HIP_CHECK_REQUIRED)" = 1 ]; then \
	    echo "hip-check: hipcc not found (apt-get install -y hipcc libamdhip64-dev)"; exit 1; \
	else echo "hip-check: SKIPPED, hipcc not found (apt-get install -y hipcc libamdhip64-dev)"; fi

# On a machine with a CUDA GPU: kernel parity, training with the TE spec, bf16 and a REFT
# snapshot every iteration, a crash and REFT-load compared bit for bit, iteration times
# and downtime in a table (tools/gpu_smoke.sh; exit 2 without CUDA).
gpu-smoke: install
	tools/gpu_smoke.sh $(ARGS)

# `make chaos` (~12 min on 2 cores): a seeded chaos campaign (tools/chaos.py,
# docs/chaos.md): random faults at random moments (every --inject-fault phase, kills,
# hangs, lost nodes, corrupted snapshots, a full /dev/shm, faults sent from outside),
# one per torchrun attempt, 5 per job run, across TP2xDP2 arc, PP2xDP2 ZeRO-1 arc,aor,
# DP4 aec, DP4 ZeRO-1 aec,aor and interleaved PP2 arc; every run compared bit for bit
# with the failure-free run.
# Exit 1 on any outcome that is not exact. CHAOS_SEED / CHAOS_FAULTS / ARGS to vary it.
CHAOS_SEED   ?= 1
CHAOS_FAULTS ?= 60
CHAOS_DIR    ?= runs/chaos
CHAOS_LAYOUTS ?= tp2dp2:arc pp2dp2-zero1:arc,aor dp4:aec dp4-zero1:aec,aor \
	pp2-interleaved:arc
chaos: install
	mkdir -p $(CHAOS_DIR)
	$(PY) tools/chaos.py --seed $(CHAOS_SEED) --faults $(CHAOS_FAULTS) --faults-per-run 5 \
	    --layouts $(CHAOS_LAYOUTS) --work-dir $(CHAOS_DIR) \
	    --out $(CHAOS_DIR)/results.json $(ARGS) 2>&1 | tee $(CHAOS_DIR)/chaos.log

bench: install
	$(PY) benchmarks/bench_kernels.py

clean:
	rm -rf build *.egg-info reft_ext/_C*.so
