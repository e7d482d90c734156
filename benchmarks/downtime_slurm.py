"""bench_downtime.py's Slurm rows: the same failures on a real Slurm of four local nodes
(tools/local_slurm.py), examples/slurm/tiny_cpu.sbatch submitted with the real sbatch in
both restart modes (RESTART=in-process: coordinator + node agents with warm workers;
RESTART=torchrun: torchrun agents and the c10d rendezvous).

crash: rank 1 SIGKILLed before its optimizer step of iteration 5 (``--inject-fault 1:5``),
2 nodes (in-process: the node's warm worker takes the rank; torchrun restarts both);
node (3 nodes, one a spare): once iteration 4 is logged, node 2 is lost from outside (every process of the
job on it SIGKILLed, its shared memory wiped) and the spare node takes its ranks. The
moment of the fault is the ``fault`` event (the bench writes it itself for a lost node).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.files import open_nofollow  # noqa: E402
from tools import local_slurm  # noqa: E402

MODES = ("slurm torchrun", "slurm in-process")
JOB = {"TRAIN_ARGS": "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
                     "--min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style cosine",
       "LOG_ARGS": "--log-interval 1 --eval-interval 1000 --eval-iters 0",
       "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "SAVE_INTERVAL": "100",
       "PYTHONWARNINGS": "ignore",
       "RDZV_CONF": "keep_alive_interval=1,keep_alive_max_attempt=3"}


class Cluster:
    """A local Slurm for the benchmark's lifetime (``with Cluster() as c: c.run(...)``)."""

    def __enter__(self):
        why = local_slurm.unavailable()
        if why:
            sys.exit(f"bench_downtime --slurm: {why}")
        self.dir = tempfile.mkdtemp(prefix="reft-bench-slurm-")
        self.env = local_slurm.up(self.dir, nodes=3)
        return self

    def __exit__(self, *exc):
        local_slurm.down(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, scenario: str, mode: str, events: str, tmp: str) -> None:
        submit = tempfile.mkdtemp(dir=tmp)
        os.makedirs(os.path.join(submit, "logs"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(self.env)
        env.update(JOB, REPO=REPO, VENV=os.path.dirname(os.path.dirname(
            sys.executable)), CKPT_DIR=os.path.join(submit, "ckpt"), REFT_EVENTS_FILE=events,
            PYTHONPATH=REPO, RESTART=mode.split()[1])
        faults, nodes = [], 2
        if scenario == "crash":  # no spare node: torchrun restarts on the same two
            env["EXTRA_ARGS"] = "--inject-fault 1:5"
        else:
            def lose(job_id):
                with open_nofollow(events, "a") as f:  # the fault's moment, as the trainer's are
                    f.write(json.dumps({"event": "fault", "time": time.time(),
                                        "rank": 1}) + "\n")
                local_slurm.lose_node(job_id, local_slurm.node_name(2),
                                      [f"/dev/shm/reft-{job_id}-*/node1"])
            faults, nodes, env["SPARE_NODES"] = [(r"iteration +4/ +10 \|", lose)], 3, "1"
        script = os.path.join(REPO, "examples", "slurm", "tiny_cpu.sbatch")
        job_id, _, out = local_slurm.submit(env, script, submit, [f"--nodes={nodes}"],
                                            faults, 600)
        text = open(out, errors="replace").read()
        for pid in local_slurm.job_processes(job_id):
            os.kill(pid, 9)
        if f"job {job_id}: exit 0" not in text:
            sys.exit(f"{scenario}, {mode}: job {job_id} failed:\n{text[-6000:]}")
