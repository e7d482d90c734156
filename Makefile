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

.PHONY: install run test test-all bench clean

$(STAMP): setup.py pyproject.toml constraints.txt csrc/setup_ext.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.10"
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -c "import reft_ext._native as n; print('[reft_ext] native engine:', n.info())"
	touch $(STAMP)

install: $(STAMP)

# The default job: tiny Llama, TP1 x PP2 x DP2 with the distributed optimizer (ZeRO-1),
# on the shipped public-domain corpus, checkpoints every 100 iterations.
run: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) pretrain_llama.py \
	    --model-size tiny --pipeline-model-parallel-size 2 --use-distributed-optimizer \
	    --micro-batch-size 4 --global-batch-size 32 --train-iters 300 \
	    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
	    --log-interval 10 --eval-interval 100 --eval-iters 4 \
	    --save $(RUN_DIR)/checkpoints --load $(RUN_DIR)/checkpoints --save-interval 100 \
	    --tensorboard-dir $(RUN_DIR)/tensorboard $(ARGS)

# `make test` (CI, < 20 min on 2 cores) covers every capability end to end once;
# `make test-all` adds the other layouts and schemes of the long recovery tests (~40 min).
test: install
	$(PY) -m pytest -q -m "not slow" tests

test-all: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) benchmarks/bench_kernels.py

clean:
	rm -rf build *.egg-info reft_ext/_C*.so
