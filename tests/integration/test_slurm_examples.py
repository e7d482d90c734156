"""The example Slurm scripts (examples/slurm, examples/frontier) run on this host through
stand-ins for sbatch, srun, scontrol and module (tests/harness/slurm_standin/standin.py): their
own logic runs unchanged (rendezvous host from scontrol, one srun task per node, torchrun
with the c10d rendezvous, spares, restarts, the REFT flags, the job's verdict), only the
model, layout and data are swapped for the tiny CPU ones through the scripts' documented
environment overrides. The GPU scripts' real arguments are checked against the trainer's
parser and validation at their real world sizes (dry run)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.harness.oracle import assert_same_checkpoint
from tests.harness.run import ENV_PATH, REPO, RunResult, parse

from tools import local_slurm
from tools.launch_nodes import free_port

STANDIN = os.path.join(REPO, "tests", "harness", "slurm_standin")
TINY_CPU = "examples/slurm/tiny_cpu.sbatch"
NVIDIA = "examples/slurm/llama2_7b_nvidia.sbatch"
FRONTIER = "examples/frontier/llama2_34b.sbatch"
SHELL_FILES = sorted(glob.glob(os.path.join(REPO, "examples", "*", "*.sh")) +
                     glob.glob(os.path.join(REPO, "examples", "*", "*.sbatch")) +
                     [os.path.join(STANDIN, "module")])

# The GPU scripts' model, layout, data and schedule swapped for the tiny CPU ones (the
# same for both, so that their runs are comparable bit for bit); REFT, checkpoint and
# launch flags stay the scripts' own.
TINY_OVERRIDES = {
    "MODEL_ARGS": "--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
                  "--num-query-groups 2 --ffn-hidden-size 128 --seq-length 32 "
                  "--hidden-dropout 0.1 --attention-dropout 0.1",
    "PARALLEL_ARGS": "--use-distributed-optimizer",  # DP 2 over the 2 nodes, ZeRO-1
    "DATA_ARGS": "--mock-data --tokenizer-type NullTokenizer --vocab-size 128",
    "TRAIN_ARGS": "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 "
                  "--min-lr 1e-4 --lr-warmup-iters 2",
    "LOG_ARGS": "--log-interval 1 --eval-interval 1000 --eval-iters 0",
    "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
    "SPARE_NODES": "0", "MIN_NODES": "2",
    # the stand-in srun starts one process per task: torchrun's path (the in-process
    # restart runs on the real Slurm: tests/integration/test_slurm_real.py)
    "RESTART": "torchrun",
    # a dead agent leaves the rendezvous after 3 s instead of torch's 15 s
    "RDZV_CONF": "keep_alive_interval=1,keep_alive_max_attempt=3",
}


@dataclass
class Job:
    rc: int
    job_id: str
    output: str      # the job's .out: batch script + every srun task, labelled
    out_path: str
    log_dir: str     # per-node logs

    def run(self) -> RunResult:
        return parse(self.output, self.rc)


def _clean(job_id: str) -> tuple[list[int], list[str]]:
    """Kill what the job left running and remove its shared memory; return both."""
    left = local_slurm.job_processes(job_id)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shm = glob.glob(f"/dev/shm/reft-{job_id}-*")
    for p in shm:
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
    return left, shm


def sbatch(script: str, tmp_path, *options: str, timeout: float = 240, **env) -> Job:
    """Submit ``script`` with the stand-in sbatch from a fresh submit directory; wait for
    the job; clean up after it whatever happened."""
    submit = tmp_path / "submit"
    os.makedirs(submit / "logs", exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    full.pop("TORCHELASTIC_RESTART_COUNT", None)
    full.update(PATH=os.pathsep.join([STANDIN, os.path.dirname(sys.executable),
                                      full.get("PATH", "")]),
                REPO=REPO, VENV=os.path.dirname(os.path.dirname(sys.executable)),
                RDZV_PORT=str(free_port()), PYTHONWARNINGS="ignore", **ENV_PATH)
    full.update(env)
    proc = subprocess.Popen([os.path.join(STANDIN, "sbatch"), *options,
                             os.path.join(REPO, script)], cwd=submit, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        said, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        said, _ = proc.communicate()
    m = re.search(r"Submitted batch job (\d+)", said)
    assert m, said
    job_id = m.group(1)
    left, _ = _clean(job_id)
    outs = glob.glob(str(submit / "logs" / f"*-{job_id}.out"))
    output = open(outs[0], errors="replace").read() if outs else ""
    assert proc.returncode is not None and proc.returncode >= 0, \
        f"sbatch timed out after {timeout} s:\n{said}\n{output[-6000:]}"
    assert not left, f"job {job_id} left processes behind: {left}"
    return Job(proc.returncode, job_id, output, outs[0] if outs else "",
               os.path.join(str(submit), "logs", os.path.basename(outs[0])[:-4])
               if outs else "")


# ---- the scripts as text ------------------------------------------------------------------
@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_scripts_parse(path):
    subprocess.run(["bash", "-n", path], check=True)
    if shutil.which("shellcheck"):  # lint too where it is installed
        r = subprocess.run(["shellcheck", "-x", path], cwd=REPO, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout


def _dry_run(script, tmp_path, **env) -> tuple[list[str], list[str], str]:
    env.setdefault("RESTART", "torchrun")
    job = sbatch(script, tmp_path, DRY_RUN="1", DATA_PATH="/shared/data/text_document",
                 CKPT_DIR="/shared/ckpt/run", **env)
    assert job.rc == 0, job.output
    line = {k: shlex.split(re.search(rf"\[launch\] dry run: {k}:(.*)", job.output).group(1))
            for k in ("torchrun", "trainer")}
    return line["torchrun"], line["trainer"], job.output


def _dp_groups(world: int, tp: int, pp: int) -> list[list[int]]:
    """megatron-core's rank order (tp fastest, then dp, then pp)."""
    dp = world // (tp * pp)
    return [[t + tp * (d + dp * p) for d in range(dp)] for p in range(pp) for t in range(tp)]


@pytest.mark.parametrize("script,nodes,spares,nnodes,protect", [
    (NVIDIA, 18, 2, "15:16", "arc"), (FRONTIER, 66, 2, "64:64", "arc,aor"),
    (TINY_CPU, 2, 0, "2:2", "arc")], ids=["nvidia-7b", "frontier-34b", "tiny-cpu"])
def test_dry_run_flags_exist_and_layouts_validate(script, nodes, spares, nnodes, protect,
                                                  tmp_path, monkeypatch):
    """Each script's real command lines, as node 0 would run them: every torchrun and
    trainer flag exists, and the trainer accepts the layout at the job's real world size
    (and at the elastic minimum), with REFT's placement rule (each sharding group spread
    over distinct nodes) satisfied."""
    from torch.distributed.run import get_args_parser

    from megatron.training.arguments import build_parser, validate_args
    from reft_ext.config import ReftConfig
    from reft_ext.protect.placement import check_placement

    torchrun, trainer, out = _dry_run(script, tmp_path)
    assert f"{nodes} node(s) allocated" in out and f"{spares} hot spare(s)" in out
    assert torchrun[1:3] == ["-m", "reft_ext.cluster.torchrun"], torchrun
    t = get_args_parser().parse_args(torchrun[3:])  # after python -m reft_ext.cluster.torchrun
    assert (t.nnodes, t.rdzv_backend, t.rdzv_endpoint.split(":")[0]) == \
        (nnodes, "reft", "127.0.1.10")  # the first node of the allocation
    assert t.rdzv_conf.startswith("is_host=false") and int(t.max_restarts) >= 2
    assert t.local_addr == "127.0.1.10" and t.training_script.endswith("pretrain_llama.py")
    per_node = int(t.nproc_per_node)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.delenv("REFT_MIN_NODES", raising=False)
    for n in sorted({int(x) for x in nnodes.split(":")}):
        args = build_parser().parse_args(trainer)  # an unknown flag exits here
        args.world_size = n * per_node
        validate_args(args)
        cfg = ReftConfig.from_args(args)
        assert cfg.enabled and cfg.protect == protect and cfg.snapshot_every == 1
        check_placement(cfg, args.world_size, _dp_groups(
            args.world_size, args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size))
        assert args.save == args.load and cfg.flush_dir.startswith(args.save)
        assert args.reft_hang_timeout > 0 and args.reft_health_check == "on"


# ---- real runs --------------------------------------------------------------------------
def _assert_clean_run(job: Job, nodes: int):
    assert job.rc == 0, job.output[-6000:]
    assert re.search(rf"\[reft_job\] job {job.job_id}: exit 0", job.output)
    for n in range(nodes):  # one log per node, named by its Slurm node id and host
        log = os.path.join(job.log_dir, f"node{n}-127.0.1.{10 + n}.log")
        assert os.path.isfile(log), os.listdir(job.log_dir)
    store = open(os.path.join(job.log_dir, "rdzv-store.log")).read()
    assert "listening" in store and "stopped (SIGTERM)" in store, store
    assert not glob.glob(f"/dev/shm/reft-{job.job_id}-*")


@pytest.mark.parametrize("script,nodes,spares,restart", [
    (FRONTIER, 66, 2, "in-process"), (TINY_CPU, 2, 0, "in-process"),
    (NVIDIA, 18, 2, "torchrun")], ids=["frontier-34b", "tiny-cpu", "nvidia-7b"])
def test_dry_run_restart_mode(script, nodes, spares, restart, tmp_path):
    """RESTART's default: in-process for a job of fixed size, torchrun for an elastic one
    (the 7B script's 15:16 nodes); in-process runs the node agent with the job's shape."""
    job = sbatch(script, tmp_path, DRY_RUN="1", DATA_PATH="/shared/data/text_document",
                 CKPT_DIR="/shared/ckpt/run")
    assert job.rc == 0, job.output
    assert f"restart {restart};" in job.output
    if restart == "in-process":
        agent = shlex.split(re.search(r"\[launch\] dry run: node_agent:(.*)",
                                      job.output).group(1))
        world = int(agent[agent.index("--world-size") + 1])
        per_node = int(agent[agent.index("--ranks-per-node") + 1])
        assert world == (nodes - spares) * per_node and agent[2] == "reft_ext.cluster.node_agent"
        assert int(agent[agent.index("--workers") + 1]) == per_node + 1  # one warm spare
    r = sbatch(script, tmp_path / "elastic", DRY_RUN="1", RESTART="in-process",
               MIN_NODES="1", DATA_PATH="/d", CKPT_DIR="/c")
    assert r.rc == 2 and "an elastic job needs RESTART=torchrun" in r.output, r.output


@pytest.fixture(scope="module")
def nvidia_tiny(tmp_path_factory) -> Job:
    """The 7B script with the tiny model: the failure-free reference of the node-loss run."""
    tmp = tmp_path_factory.mktemp("nvidia")
    job = sbatch(NVIDIA, tmp, "--nodes=2", CKPT_DIR=str(tmp / "ckpt"),
                 EXTRA_ARGS="--log-params-hash --log-loss-history", **TINY_OVERRIDES)
    job.checkpoint = str(tmp / "ckpt")  # its final checkpoint: the oracle's reference
    return job


@pytest.mark.slow  # torchrun's mode on the real Slurm is in the default tier (test_slurm_real)
def test_nvidia_script_tiny_run(nvidia_tiny):
    _assert_clean_run(nvidia_tiny, 2)
    run = nvidia_tiny.run()
    assert sorted(run.hashes) == [0, 1] and sorted(run.losses) == list(range(1, 7))
    assert "training on 2:2 x 1 ranks" in nvidia_tiny.output
    assert "[REFT] snapshots of iteration 6: 1 x " in nvidia_tiny.output  # --log-interval 1


@pytest.mark.slow  # the real Slurm's node-loss tests are in the default tier
def test_frontier_script_node_loss_recovered_by_hot_spare(nvidia_tiny, tmp_path):
    """3 nodes, one of them a hot spare that joins once the job runs. Rank 1 freezes
    before its optimizer step of iteration 4 and its node is lost (processes killed,
    /dev/shm wiped). The spare takes its ranks: its slice comes back from the ARC replica
    and its ZeRO-1 shard from the AOR replica on rank 0, the survivor reloads its own
    memory, and the run ends bit-identical to the failure-free run of the 7B script."""
    job = sbatch(FRONTIER, tmp_path, "--nodes=3", CKPT_DIR=str(tmp_path / "ckpt"),
                 EXTRA_ARGS="--log-params-hash --log-loss-history --inject-fault 1:4:STOP",
                 **dict(TINY_OVERRIDES, SPARE_NODES="1", MIN_NODES="2"),
                 STANDIN_LATE_NODE=r"2:iteration +1/",
                 STANDIN_KILL_NODE=r"1:\[FAULT\] injecting SIGSTOP into rank 1 ")
    out = job.output
    assert job.rc == 0, out[-6000:]
    assert "3 node(s) allocated, training on 2:2 x 1 ranks, 1 hot spare(s)" in out
    spare = out.index("[standin srun] node 2 (127.0.1.12) starts now")
    fault = out.index("1: [FAULT] injecting SIGSTOP into rank 1")
    lost = out.index("[standin srun] node 1 (127.0.1.11) lost")
    assert spare < fault < lost
    # the survivor's watcher saved its snapshots (save-on-failure) when its worker died
    assert re.search(r"0: \[REFT\] flushed node 0's snapshots \(ranks \[0\]", out)
    assert ("2: [REFT] recovered iteration 3 on rank 1 from ARC replica, optimizer shard "
            "from the AOR replica on rank 0") in out, out[-6000:]
    assert "0: [REFT] recovered iteration 3 on rank 0 from own memory" in out
    # srun reports the lost node's task (SIGKILL: 137); the verdict looks at the checkpoint
    assert "srun exited with 137 (a node or task was lost on the way)" in out
    assert "training completed" in out and f"job {job.job_id}: exit 0" in out
    assert not glob.glob(f"/dev/shm/reft-{job.job_id}-*")
    run, ref = job.run(), nvidia_tiny.run()
    assert ref.returncode == 0 and run.hashes == ref.hashes
    run.checkpoint, ref.checkpoint = str(tmp_path / "ckpt"), nvidia_tiny.checkpoint
    assert_same_checkpoint(run, ref)  # item by item, not REFT's list of tensors
    assert sorted(run.losses) == [4, 5, 6]  # the last rank's final attempt (the spare)
    assert all(run.losses[i] == ref.losses[i] for i in run.losses)
