"""A shipped sbatch script's dry run through the Slurm stand-ins (tests/harness/
slurm_standin): the script's own logic builds its srun, launcher and trainer commands and
the workers' environment for node 0, and prints them instead of starting anything
(reft_job.sh and launch_node.sh with DRY_RUN=1). Returns the job's output."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

from tests.harness.run import ENV_PATH, REPO

STANDIN = os.path.join(REPO, "tests", "harness", "slurm_standin")
NVIDIA = "examples/slurm/llama2_7b_nvidia.sbatch"
FRONTIER = "examples/frontier/llama2_34b.sbatch"


def dry_run(script: str, submit_dir, **env) -> tuple[int, str]:
    """(exit status, the job's .out) of ``script`` submitted with DRY_RUN=1."""
    os.makedirs(os.path.join(submit_dir, "logs"), exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full.update(PATH=os.pathsep.join([STANDIN, os.path.dirname(sys.executable),
                                      full.get("PATH", "")]),
                REPO=REPO, VENV=os.path.dirname(os.path.dirname(sys.executable)),
                RDZV_PORT="29999", PYTHONWARNINGS="ignore", DRY_RUN="1", **ENV_PATH)
    full.update(env)
    r = subprocess.run([os.path.join(STANDIN, "sbatch"), os.path.join(REPO, script)],
                       cwd=submit_dir, env=full, capture_output=True, text=True, timeout=120)
    m = re.search(r"Submitted batch job (\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    outs = glob.glob(os.path.join(submit_dir, "logs", f"*-{m.group(1)}.out"))
    return r.returncode, open(outs[0], errors="replace").read() if outs else r.stdout


def dry_run_line(output: str, what: str) -> list[str]:
    """The words of a ``[launch] dry run: WHAT:`` line (trainer, torchrun, env, ...)."""
    m = re.search(rf"\[launch\] dry run: {what}:(.*)", output)
    assert m, f"no '{what}' line in the dry run:\n{output[-3000:]}"
    return shlex.split(m.group(1))
