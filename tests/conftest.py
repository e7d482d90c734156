"""Shared helpers: run the real trainer under real torchrun on loopback and parse what
it prints ([HASH], [LOSSES], [FAULT] lines)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small Llama that still has every feature: GQA, SwiGLU, RoPE, RMSNorm, dropout.
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--log-params-hash", "--log-loss-history"]

LAYOUTS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "8"],
    "pp2dp2-zero1": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                     "--global-batch-size", "8"],
    "dp4": ["--global-batch-size", "8"],
    "pp2-interleaved": ["--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1",
                        "--global-batch-size", "8"],
}


@dataclass
class RunResult:
    returncode: int
    output: str
    hashes: dict = field(default_factory=dict)   # rank -> sha256 of the whole state
    losses: dict = field(default_factory=dict)   # iteration -> loss (float.hex)
    iteration: int | None = None

    def check(self):
        assert self.returncode == 0, self.output[-6000:]
        return self


def parse(output: str, returncode: int) -> RunResult:
    res = RunResult(returncode, output)
    for m in re.finditer(r"\[HASH\] rank (\d+) iteration (\d+) state ([0-9a-f]+)", output):
        res.hashes[int(m.group(1))] = m.group(3)
        res.iteration = int(m.group(2))
    for m in re.finditer(r"\[LOSSES\] rank \d+ (.*)", output):
        for it, val in re.findall(r"(\d+):(-?0x[0-9a-f.]+p[+-]\d+|nan|inf)", m.group(1)):
            res.losses[int(it)] = val
    return res


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, timeout: int = 300,
             env: dict | None = None, script: str = "pretrain_llama.py") -> RunResult:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           os.path.join(REPO, script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    full_env.pop("TORCHELASTIC_RESTART_COUNT", None)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out after {timeout} s:\n{out[-6000:]}")
    try:  # nothing a test started may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return parse(out, proc.returncode)


@pytest.fixture(scope="session")
def reference_runs():
    """Failure-free runs, computed once per session and shared by every test (in any
    file) that compares against the same command line. The cache is keyed by the command
    line itself, so two tests can never share a run of different flags; ``name`` only
    documents the call site."""
    cache: dict = {}

    def get(name: str, nproc: int, args: list[str]) -> RunResult:
        key = (nproc, tuple(args))
        if key not in cache:
            cache[key] = torchrun(nproc, args).check()
        return cache[key]

    return get


@pytest.fixture
def cpu_hog():
    """A busy host for the test's duration: two busy loops per CPU this process may use
    (the load of other jobs sharing the cores), killed afterwards. Yields their count.
    Each in a session of its own, as every torchrun agent and worker is: the kernel's
    autogroups share the CPUs out between sessions first, so loops in the test's own
    session would hardly slow a job at all."""
    n = 2 * len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(n)]
    try:
        yield n
    finally:
        for p in hogs:
            p.kill()
        for p in hogs:
            p.wait()
