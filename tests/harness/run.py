"""Run the real trainer (or a worker script) under real torchrun on loopback and parse what
it prints ([HASH], [LOSSES], [FAULT] lines). Shared by every test; fixtures are in
tests/conftest.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# worker scripts and tools import the repository's packages (tests.harness, tools) too
ENV_PATH = {"PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)}

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
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **ENV_PATH)
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
