"""tools/gpu_smoke.sh cannot rot: its dry run's trainer commands parse with the trainer's own
argument parser, and without CUDA it refuses with exit 2 and a message."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from megatron.training.arguments import build_parser
from tests.harness.run import REPO

SCRIPT = os.path.join(REPO, "tools", "gpu_smoke.sh")
# flags other work adds to arguments.py; checked as soon as the parser knows them
PENDING = {"--transformer-impl"}


def _dry_run(tmp_path, **env) -> list[list[str]]:
    e = dict(os.environ, GPU_SMOKE_DRY_RUN="1", GPU_SMOKE_DIR=str(tmp_path), **env)
    r = subprocess.run(["bash", SCRIPT], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    cmds = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert not os.listdir(tmp_path), "a dry run must not run anything"
    return cmds


def _known_flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _trainer_args(cmd: list[str]) -> list[str]:
    args = cmd[cmd.index("pretrain_llama.py") + 1:]
    return args[:args.index(">")] if ">" in args else args


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_every_trainer_flag_of_the_smoke_parses(tmp_path, impl):
    cmds = _dry_run(tmp_path, GPU_SMOKE_IMPL=impl)
    runs = [c for c in cmds if "pretrain_llama.py" in c]
    # failure-free HAS, crash, no-snapshot, end-of-iteration
    assert len(runs) == 4
    parser = build_parser()
    known = _known_flags(parser)
    pending = PENDING - known
    parsed = []
    for cmd in runs:
        assert cmd[cmd.index("--nproc-per-node") + 1] == "1"
        args = _trainer_args(cmd)
        for flag in pending:  # not in arguments.py yet: strip it with its value
            i = args.index(flag)
            assert args[i + 1] == impl
            del args[i:i + 2]
        unknown = [a for a in args if a.startswith("--") and a not in known]
        assert not unknown, f"gpu_smoke.sh uses trainer flags the parser lacks: {unknown}"
        parsed.append(parser.parse_args(args))
    ref, crash, nosnap, eoi = parsed
    assert ref.bf16 and ref.reft_snapshot_every == 1 and ref.reft_schedule == "has"
    assert ref.use_distributed_optimizer
    assert ref.distributed_backend == "nccl"
    assert crash.inject_fault == "0:150" and crash.save != ref.save
    assert nosnap.reft_snapshot_every == 0
    assert eoi.reft_schedule == "end-of-iteration"
    if "--transformer-impl" in known:
        assert ref.transformer_impl == impl
    # the crash run may restart once; the comparison reads the two final checkpoints
    assert runs[1][runs[1].index("--max-restarts") + 1] == "1"
    compare = next(c for c in cmds if "tools/compare_checkpoints.py" in c)
    assert compare[compare.index("tools/compare_checkpoints.py") + 1:][:2] == [ref.save, crash.save]
    # the kernel parity tests it names exist
    parity = next(c for c in cmds if "pytest" in c)
    for t in (a for a in parity if a.startswith("tests/")):
        assert os.path.isfile(os.path.join(REPO, t)), t


def test_refuses_without_cuda_with_exit_2(tmp_path):
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the script would run")
    r = subprocess.run(["bash", SCRIPT], cwd=REPO, env=dict(os.environ, GPU_SMOKE_DIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr and r.stdout == ""
