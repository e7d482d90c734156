"""What a newcomer's terminal shows (issue 52): the first screen of `make run` has no
warning line (megatron-core's and torch's known notes muted by their wording, named in one
[REFT] line: megatron/training/fallbacks.py; nor does tools/preprocess_data.py --help),
`make run-inprocess` shows the job's log as `make run` does, each line prefixed with its
rank as torchrun prefixes it (tools/log_follow.py), and `make demo-nodes ARGS=...` hands
ARGS to its failure-free run (the demo's own) and moves the lost node into the shorter run.

The recipes are the Makefile's own (``make -n``, then run with bash from the repository
root as make runs them), shortened by ``ARGS`` and ``NPROC``; PYTHONWARNINGS is unset as in
a user's shell (the harness otherwise ignores warnings)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.harness.run import REPO

from tools.log_follow import LogFollower

pytestmark = pytest.mark.timeout(400)
SHORT = "--train-iters 2 --lr-warmup-iters 1 --eval-iters 1 --eval-interval 2 --log-interval 1"


def recipe(target: str, **make_vars: str) -> str:
    """The shell commands `make TARGET VAR=...` runs, without the install step's (the
    venv is there: the test runs in it)."""
    out = subprocess.run(["make", "-s", "-n", target, *(f"{k}={v}" for k, v in
                                                          make_vars.items())],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(("mkdir -p", ".venv/bin/python tools/run_log.py --mkdir")))
    return "\n".join(lines[first:])


def run_recipe(target: str, tmp_path, **make_vars: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONPATH")}
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", recipe(target, **make_vars)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def warning_lines(screen: str) -> list[str]:
    return [line for line in screen.splitlines() if "Warning" in line or "warn" in line]


def test_make_run_first_screen_has_no_warning_line(tmp_path):
    """DP 2 with ZeRO-1: megatron-core's reduce-scatter, all-gather and zero_grad (each
    a warning per rank before; REFT_SHOW_LIBRARY_NOTES=1 shows them again). Under
    --reft-protect arc (no aor) one [REFT] line says the optimizer shards are bare; the
    argument table, the dataset lines and TensorBoard read as Megatron-LM's (issue 59)."""
    out = run_recipe("run", tmp_path, RUN_DIR=str(tmp_path / "run"), NPROC="2",
                     ARGS=f"--pipeline-model-parallel-size 1 --reft-protect arc {SHORT}")
    bare = [line for line in out.splitlines() if "ZeRO-1 optimizer shards unprotected" in line]
    assert len(bare) == 1 and bare[0].startswith("[REFT] ") and \
        "a lost node costs the persistent checkpoint" in bare[0] and \
        "--reft-protect arc,aor covers them" in bare[0], bare or out[:4000]
    # what the run uses: gloo on CPU, the shipped corpus
    assert re.search(r"^  distributed_backend \.+ gloo$", out, re.M), out[:6000]
    assert re.search(r"^  data_path \.+ \['\S+/data/pd_english_text_document'\]$", out, re.M)
    assert ("> building train, validation, and test datasets ...\n"
            " > datasets target sizes (minimum size):\n"
            "    train:      64\n    validation: 64\n    test:       32\n"
            "> building train, validation, and test datasets for GPT ...") in out, out[:8000]
    from tests.integration.test_log_lines import tensorboard_scalars

    tags = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for name in ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm"):
        assert [s for s, _ in tags[name]] == [1, 2], (name, sorted(tags))
        assert [s for s, _ in tags[f"{name} vs samples"]] == [32, 64], name
    for name in ("lm loss validation", "lm loss validation ppl"):
        assert [s for s, _ in tags[f"{name} vs samples"]] == [64], (name, sorted(tags))
    assert 0 < tags["iteration-time"][0][1] < 60  # seconds, as Megatron-LM writes it
    assert not warning_lines(out), "\n".join(warning_lines(out))
    muted = [line for line in out.splitlines() if line.startswith("[REFT] muted by their")]
    assert len(muted) == 1 and "reduce_scatter_tensor" in muted[0], out[:4000]
    screen = out[:out.index("---- arguments ----")]
    assert "[REFT] health:" in screen and "megatron-core: " in screen, screen
    assert re.search(r" iteration +2/ +2 \|", out), out[-3000:]


def test_preprocess_data_help_prints_no_warning():
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr[-2000:]  # megatron-core's 4 fallback notes before


@pytest.mark.slow  # 4 ranks, TP 2 (megatron-core's CUDA_DEVICE_MAX_CONNECTIONS advice)
def test_make_run_first_screen_at_tp2_has_no_warning_line(tmp_path):
    out = run_recipe("run", tmp_path, RUN_DIR=str(tmp_path / "run"),
                     ARGS=f"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
                          f"{SHORT}")
    assert not warning_lines(out), "\n".join(warning_lines(out))
    assert re.search(r" iteration +2/ +2 \|", out), out[-3000:]


@pytest.mark.slow  # the in-process supervisor's job of 4 ranks and a spare
def test_make_run_inprocess_shows_the_jobs_log_on_the_terminal(tmp_path):
    out = run_recipe("run-inprocess", tmp_path, RUN_DIR=str(tmp_path / "run"), ARGS=SHORT)
    # Megatron's iteration line comes from the last pipeline stage (rank 3), the
    # argument table from rank 0, each as torchrun --tee prefixes a worker's line
    assert re.search(r"^\[default3\]: \[.*\] iteration +2/ +2 \|", out, re.M), out[-4000:]
    assert "[default0]:------------------------ arguments" in out, out[:4000]
    assert out.count("[default0]:[REFT] muted by their") == 1, out[:4000]
    with open(os.path.join(tmp_path, "run", "launcher.log")) as f:
        assert re.search(r"\[default3\]: \[.*\] iteration +2/", f.read())  # tee'd too


def test_log_follower_prints_each_ranks_new_lines_once_with_its_prefix(tmp_path):
    import io

    a, b, spare = (str(tmp_path / n) for n in ("w0.log", "w1.log", "spare.log"))
    logs = {0: [a], 1: [b]}
    out = io.StringIO()
    follower = LogFollower(lambda: logs, out=out, every=3600)  # polled by hand below
    with open(a, "w") as f:
        f.write("table\nhalf a li")
    follower.poll()  # w1.log not there yet: skipped
    assert out.getvalue() == "[default0]:table\n"
    with open(a, "a") as f:
        f.write("ne\n")
    with open(spare, "w") as f:
        f.write("spare waiting\ntook rank 1\n")
    logs[1].append(spare)  # a warm spare replaced rank 1: its file from its start
    follower.poll()
    assert out.getvalue().splitlines() == ["[default0]:table", "[default0]:half a line",
                                           "[default1]:spare waiting", "[default1]:took rank 1"]
    with open(spare, "a") as f:
        f.write("no newline at the end")
    follower.start()
    follower.stop()  # the last partial line too
    assert out.getvalue().endswith("[default1]:no newline at the end\n")


def test_make_demo_nodes_passes_args_to_its_baseline_and_moves_the_fault():
    """`make demo-nodes ARGS="--train-iters 40"`: the node lost at 5/6 of the run, and
    the failure-free run the demo makes of the same flags (tools/demo.py: its own, one
    per set of flags), never `make run`'s directory."""
    short = " ".join(recipe_lines("demo-nodes", ARGS="--train-iters 40"))
    assert "--inject-fault 2:33:KILL:node --train-iters 40" in short, short
    assert "--reference-dir runs/demo-nodes-reference --" in short, short
    assert "runs/default" not in short and "--compare" not in short, short
    full = " ".join(recipe_lines("demo-nodes"))
    assert "2:250:KILL:node" in full, full
    demo = " ".join(recipe_lines("demo"))
    assert "--reference-dir runs/demo-reference --" in demo and "--compare" not in demo


def recipe_lines(target: str, **make_vars: str) -> list[str]:
    """Every line `make -n TARGET` prints (a baseline's sub-make prints its own)."""
    return subprocess.run(["make", "-s", "-n", target, *(f"{k}={v}" for k, v in
                                                          make_vars.items())],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
