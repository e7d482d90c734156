"""Every shipped cluster script starts: its trainer command and the environment its workers
inherit, built by the script itself (a dry run through the Slurm stand-ins) for both
RESTART modes, go through the trainer's whole argument validation (parse + validate, no
training) at the job's real world size, with only the facts of the script's target
supplied (megatron/training/device_facts.py): CUDA or ROCm, 8 GPUs or GCDs per node, and
the optimizers TransformerEngine or apex give megatron-core there (FusedAdam). An
in-process worker sees what the node agent gives it (REFT_INPROCESS_STORE)."""

from __future__ import annotations

import os

import pytest

from megatron.training.arguments import ArgumentError, build_parser, validate_args
from megatron.training.device_facts import DeviceFacts
from reft_ext.cluster import inprocess
from reft_ext.config import ReftConfig
from tests.harness.slurm_dry_run import FRONTIER, NVIDIA, dry_run, dry_run_line

# script -> (target platform, optimizers megatron-core gets there, allocated nodes, spares)
TARGETS = {NVIDIA: ("cuda", "transformer_engine", 18, 2),
           FRONTIER: ("rocm", "apex", 66, 2)}
CASES = [(s, r) for s in TARGETS for r in ("torchrun", "in-process")]
# the 7B script is elastic (15:16 nodes), which in-process refuses (below): its in-process
# mode is that of the same script at a fixed size
FIXED = {NVIDIA: {"MIN_NODES": "16"}}


def _built(script, tmp_path, restart, **env) -> tuple[list[str], dict, str]:
    rc, out = dry_run(script, str(tmp_path / "submit"), RESTART=restart,
                      DATA_PATH="/shared/data/text_document", CKPT_DIR="/shared/ckpt/run",
                      **env)
    assert rc == 0, out
    env_out = dict(kv.split("=", 1) for kv in dry_run_line(out, "env"))
    return dry_run_line(out, "trainer"), env_out, out


def _validate(trainer, env, facts, world, per_node, in_process, monkeypatch):
    for k in [k for k in os.environ if k.startswith(("TORCH_NCCL_", "NCCL_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.delenv("REFT_MIN_NODES", raising=False)
    if in_process:  # what the node agent's workers get (reft_ext/cluster/spare.py)
        monkeypatch.setenv(inprocess.ENV_STORE, "127.0.1.10:29400")
    else:
        monkeypatch.delenv(inprocess.ENV_STORE, raising=False)
    return _parse_validate(trainer, world, facts)


def _parse_validate(trainer, world, facts):
    """parse_args without its path checks (the data and checkpoint paths are the
    cluster's): build_parser + validate_args, the whole judgement of the flags."""
    args = build_parser().parse_args(trainer)
    args.world_size = world
    validate_args(args, facts)
    return args


@pytest.mark.parametrize("script,restart", CASES,
                         ids=[f"{s.split('/')[-1].split('.')[0]}-{r}" for s, r in CASES])
def test_every_shipped_script_passes_the_trainers_validation_on_its_target(
        script, restart, tmp_path, monkeypatch):
    platform, optimizers, nodes, spares = TARGETS[script]
    trainer, env, out = _built(script, tmp_path, restart,
                               **(FIXED.get(script, {}) if restart == "in-process" else {}))
    assert f"restart {restart};" in out
    # the mode's NCCL error handling, set by the mode (reft_job.sh), not left to defaults
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ("0" if restart == "in-process" else "1")
    facts = DeviceFacts.node_of(platform, 8, optimizers)
    per_node = 8
    training_nodes = nodes - spares
    args = _validate(trainer, env, facts, training_nodes * per_node, per_node,
                     restart == "in-process", monkeypatch)
    cfg = ReftConfig.from_args(args)
    assert cfg.enabled and args.transformer_impl == "transformer_engine"
    if cfg.aor:  # any verification interval with a snapshot every iteration
        assert cfg.snapshot_every == 1 and cfg.aor_verify_every == 100
    # the refusals this validation exists for fire on the same command line
    bad_env = dict(env, TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    if restart == "in-process":
        with pytest.raises(ArgumentError, match="^TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 makes"):
            _validate(trainer, bad_env, facts, training_nodes * per_node, per_node, True,
                      monkeypatch)
        unset = {k: v for k, v in env.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        with pytest.raises(ArgumentError, match="^TORCH_NCCL_ASYNC_ERROR_HANDLING: unset"):
            _validate(trainer, unset, facts, training_nodes * per_node, per_node, True,
                      monkeypatch)
    with pytest.raises(ArgumentError, match="^--nproc-per-node: 16 ranks per node, 8 "):
        _validate(trainer, env, facts, training_nodes * 16, 16, False, monkeypatch)


def test_nvidia_script_in_process_is_refused_as_elastic(tmp_path):
    rc, out = dry_run(NVIDIA, str(tmp_path), RESTART="in-process", DATA_PATH="/d",
                      CKPT_DIR="/c")
    assert rc == 2 and "an elastic job needs RESTART=torchrun" in out


def test_cpu_facts_skip_the_device_checks_and_node_facts_name_the_platform():
    cpu = DeviceFacts()
    assert (cpu.device, cpu.platform, cpu.optimizers) == ("cpu", "cpu", "torch")
    assert DeviceFacts.node_of("rocm").platform == "rocm"
    with pytest.raises(ValueError):
        DeviceFacts.node_of("tpu")


def test_nccl_error_handling_that_keeps_survivors():
    problem = inprocess.nccl_teardown_problem
    for keeps in ("0", "2"):
        assert problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": keeps}) is None
    assert problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})[0] == \
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    # torch reads the new name first, then the old one
    assert problem({"NCCL_ASYNC_ERROR_HANDLING": "1"})[0] == "NCCL_ASYNC_ERROR_HANDLING"
    assert problem({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                    "NCCL_ASYNC_ERROR_HANDLING": "1"}) is None
