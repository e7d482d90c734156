"""Run the real trainer (or a worker script) under real torchrun on loopback and parse what
it prints ([HASH], [LOSSES] lines) and the REFT events it records (tests/harness/events.py).
Shared by every test; fixtures are in tests/conftest.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tests.harness import events as ev
from tests.harness.oracle import with_final_checkpoint

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

# Every test's parallel layouts, by name (the name says the 4-rank job; the DP size is
# what the ranks leave). reference_runs shares failure-free runs by command line, so one
# table keeps the tests of every file on the same flags.
LAYOUTS = {
    # non-distributed optimizer: the whole state is replicated across DP
    "pp2dp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
    "tp2dp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"],
    "dp4": ["--global-batch-size", "8"],
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "8"],  # TP2 x PP2 x DP(ranks / 4)
    "pp2-interleaved": ["--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1",
                        "--global-batch-size", "8"],  # PP2 x DP2, 2 chunks per stage
    # ZeRO-1: optimizer shards are owned state, saved whole by their owner
    "pp2dp2-zero1": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                     "--global-batch-size", "8"],
    "tp2dp2-zero1": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                     "--global-batch-size", "8"],
    "dp4-zero1": ["--use-distributed-optimizer", "--global-batch-size", "8"],
}


@dataclass
class RunResult:
    returncode: int
    output: str
    hashes: dict = field(default_factory=dict)   # rank -> sha256 of the whole state
    losses: dict = field(default_factory=dict)   # iteration -> loss (float.hex)
    losses_by_rank: dict = field(default_factory=dict)  # rank -> {iteration -> loss}
    checkpoint: str | None = None  # the --save root of its final checkpoint (oracle.py)
    iteration: int | None = None
    events: ev.Events = field(default_factory=ev.Events)  # what REFT recorded, in order

    def check(self):
        assert self.returncode == 0, self.output[-6000:]
        return self

    def events_of(self, event: str, **match) -> list[dict]:
        """``result.events_of("recovered", rank=2)``: see Events.of."""
        return self.events.of(event, **match)


def wait_until(cond, timeout: float, what: str):
    """``cond()``'s first true value, polled every 50 ms; AssertionError after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def events_file(directory: str | None = None) -> str:
    """A new, empty file for one run's events (the run's processes append to it)."""
    fd, path = tempfile.mkstemp(prefix="reft-events-", suffix=".jsonl", dir=directory)
    os.close(fd)
    return path


def parse(output: str, returncode: int, events_path: str | None = None) -> RunResult:
    res = RunResult(returncode, output)
    if events_path:
        res.events = ev.load(events_path)
    for m in re.finditer(r"\[HASH\] rank (\d+) iteration (\d+) state ([0-9a-f]+)", output):
        res.hashes[int(m.group(1))] = m.group(3)
        res.iteration = int(m.group(2))
    for m in re.finditer(r"\[LOSSES\] rank (\d+) (.*)", output):
        mine = res.losses_by_rank.setdefault(int(m.group(1)), {})
        for it, val in re.findall(r"(\d+):(-?0x[0-9a-f.]+p[+-]\d+|nan|inf)", m.group(2)):
            res.losses[int(it)] = mine[int(it)] = val
    return res


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, timeout: int = 300,
             env: dict | None = None, script: str = "pretrain_llama.py") -> RunResult:
    ckpt = None
    if script == "pretrain_llama.py":
        args, ckpt = with_final_checkpoint(args)
    # the project's launcher (torchrun with the signed reft rendezvous): what users run
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           os.path.join(REPO, script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **ENV_PATH)
    full_env.pop("TORCHELASTIC_RESTART_COUNT", None)
    events = events_file()
    full_env[ev.ENV] = events
    full_env.update(env or {})
    try:
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
        res = parse(out, proc.returncode, full_env[ev.ENV])
        res.checkpoint = ckpt and os.path.join(REPO, ckpt)  # (cwd of the run: REPO)
        return res
    finally:
        os.unlink(events)
