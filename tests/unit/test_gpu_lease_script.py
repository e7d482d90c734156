"""tools/gpu_lease.sh cannot rot while no GPU is lent: its dry run prints every step's
commands (the copy-and-hash pipeline check, the paper-size model without snapshots and
with a snapshot every iteration at two N, the smoke's crash and recovery), and every
trainer command among them parses with the trainer's own argument parser."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from megatron.training.arguments import build_parser
from tests.harness.run import REPO

LEASE = os.path.join(REPO, "tools", "gpu_lease.sh")


def _dry_run(tmp_path) -> list[list[str]]:
    r = subprocess.run(["bash", LEASE], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, GPU_LEASE_DRY_RUN="1", OUT=str(tmp_path / "o"),
                                PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not os.path.exists("runs/gpu-smoke/ref"), "a dry run must not run anything"
    return [shlex.split(ln[2:]) for ln in r.stdout.splitlines() if ln.startswith("+ ")]


def _trainer_args(cmd: list[str]) -> list[str]:
    args = cmd[cmd.index("pretrain_llama.py") + 1:]
    return args[:args.index(">")] if ">" in args else args


def test_every_trainer_command_of_the_lease_parses(tmp_path):
    cmds = _dry_run(tmp_path)
    parser = build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    runs = [c for c in cmds if "pretrain_llama.py" in c]
    parsed = []
    for cmd in runs:
        args = _trainer_args(cmd)
        if "--transformer-impl" in args and "--transformer-impl" not in known:
            i = args.index("--transformer-impl")  # the smoke's flag other work adds
            del args[i:i + 2]
        unknown = [a for a in args if a.startswith("--") and a not in known]
        assert not unknown, f"gpu_lease.sh runs trainer flags the parser lacks: {unknown}"
        parsed.append((cmd, parser.parse_args(args)))
    # the paper-size model: no snapshot, then one every iteration at two fixed N, all
    # with the same model flags (one call, one card)
    big = [(c, a) for c, a in parsed if a.model_size == "llama2-1.3b"]
    assert len(big) == 3
    threads = [next(x for x in c if x.startswith("REFT_COPY_THREADS=")) for c, _ in big]
    assert threads == ["REFT_COPY_THREADS=0", "REFT_COPY_THREADS=2", "REFT_COPY_THREADS=4"]
    assert [a.reft_snapshot_every for _, a in big] == [0, 1, 1]
    assert all(a.reft_device_readahead > 0 for _, a in big[1:])  # page-locked slots
    assert all(a.bf16 and a.reft_schedule == "has" for _, a in big)
    # the smoke: a failure-free run and a crash whose final state is compared
    crash = [a for _, a in parsed if a.inject_fault]
    assert any(re.fullmatch(r"0:15", a.inject_fault) for a in crash)
    assert any("tools/compare_checkpoints.py" in c for c in cmds)
    # the pipeline check (1 GiB, N = 1, 2, 4, 8) names a tool that exists
    check = next(c for c in cmds if "tools/gpu_pipeline_check.py" in c)
    assert check[check.index("--threads") + 1] == "1,2,4,8"
    assert check[check.index("--gib") + 1] == "1"
    assert os.path.isfile(os.path.join(REPO, "tools", "gpu_pipeline_check.py"))


def test_the_lease_fits_its_budget_of_8_minutes():
    text = open(LEASE).read()
    budget = int(re.search(r"BUDGET=\$\{GPU_LEASE_BUDGET:-(\d+)\}", text).group(1))
    assert budget <= 480
    # every step runs through `bounded`, which cuts its limit to what the budget leaves
    assert "(( left < limit )) && limit=$left" in text


def test_the_pipeline_check_refuses_without_cuda():
    import pytest  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the check itself")
    r = subprocess.run([sys.executable, "tools/gpu_pipeline_check.py"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs CUDA" in r.stdout


def test_the_dry_run_lists_the_correctness_steps_before_the_performance_runs(tmp_path):
    """Within the budget the steps left out are the last ones: the build, the CUDA tests,
    the smoke and the several-ranks cases (the staging check first) come before the
    pipeline's GB/s and the paper-size model's iteration times."""
    r = subprocess.run(["bash", LEASE], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, GPU_LEASE_DRY_RUN="1", OUT=str(tmp_path / "o"),
                                PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [ln.split("] ", 1)[1] for ln in r.stdout.splitlines()
             if ln.startswith("== [")]
    kinds = [s.split(":", 1)[0] for s in steps]
    assert kinds == ["correctness"] * 4 + ["performance"] * 2, steps
    order = ["native extension", "CUDA tests", "gpu_smoke.sh", "several ranks"]
    assert all(o in s for o, s in zip(order, steps)), steps
    lines = r.stdout.splitlines()
    at = lambda text: next(i for i, ln in enumerate(lines) if text in ln)  # noqa: E731
    assert at("setup.py build_ext") < at("-m pytest") < at("tools/compare_checkpoints.py") \
        < at("--staging-check") < at("+ pretrain_llama.py") < at("gpu_pipeline_check.py") \
        < at("--model-size llama2-1.3b --seq-length 2048")
