"""The planner (issue 8): its per-rank bytes and placement match a real run's snapshot
manifests, it sizes a 34B model on meta tensors, and its flags fail with one-line errors
naming the flag."""

import glob
import json
import math
import os
import resource
import subprocess
import sys
import uuid

import pytest
from conftest import REPO, torchrun

from reft_ext import bubbles
from reft_ext.plan import PlanConfigError, plan
from reft_ext.plan.cli import main
from reft_ext.plan.hardware import HardwareConfig
from reft_ext.plan.model import ModelConfig, ParallelConfig
from reft_ext.plan.planner import Plan, SnapshotConfig
from reft_ext.plan.presets import MODEL_PRESETS, llama_ffn_hidden_size
from reft_ext.plan.state import rank_tensors

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--vocab-size", "128"]
# every path of the state derivation at once: two model chunks per stage (interleaved),
# the embedding and the output layer on different stages, bf16 params with fp32 norms
# (two DDP buffers per chunk), ZeRO-1 shards that cut parameters, ARC
LAYOUT = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
          "1", "--use-distributed-optimizer", "--bf16", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--reft-protect", "arc"]


def test_planner_matches_real_snapshot_manifests(tmp_path):
    job = f"plan-{uuid.uuid4().hex[:8]}"
    shm = tmp_path / "shm"
    shm.mkdir()
    torchrun(4, SHAPE + LAYOUT + [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "2",
        "--lr", "1e-3", "--min-lr", "1e-4", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "0", "--reft-snapshot-every", "1", "--reft-keep-snapshots",
        "--reft-ranks-per-node", "1", "--reft-job-id", job, "--reft-shm-dir", str(shm)],
        timeout=240).check()
    report = plan(SHAPE + LAYOUT + ["--data-parallel-size", "2", "--gpus-per-node", "1"])
    p = report.plan
    assert p.placement_error is None
    manifests = sorted(glob.glob(str(shm / f"reft-{job}-node*" / "rank*.slot*.json")))
    assert len(manifests) == 8  # 4 ranks x 2 slots (iterations 1 and 2)
    planned = {r["rank"]: r for r in report.to_dict()["ranks"]}
    for path in manifests:
        with open(path) as f:
            real = json.load(f)
        rank = real["rank"]
        mine = p.rank(rank)
        assert real["layout"] == mine.manifest()["layout"], path
        assert real["nbytes"] == mine.slot_bytes
        assert {k: v[:2] for k, v in real["regions"].items()} == mine.manifest()["regions"]
        # placement: the failure domain's directory and the sharding group
        node = int(os.path.basename(os.path.dirname(path)).rsplit("node", 1)[1])
        assert node == mine.node == planned[rank]["node"]
        assert real["dp_ranks"] in p.par.dp_groups() and rank in real["dp_ranks"]
        assert real["member"] == mine.member == planned[rank]["member"]
        assert planned[rank]["regions"] == mine.manifest()["regions"]


def test_presets_are_shared_with_the_trainer():
    from megatron.training import arguments

    assert arguments.MODEL_PRESETS is MODEL_PRESETS
    for h in [64, 128, 2048, 2560, 4096, 5120, 8192]:
        assert llama_ffn_hidden_size(h) == arguments.llama_ffn_hidden_size(h)
    assert llama_ffn_hidden_size(4096) == 11008  # Llama-2-7B


def test_34b_state_is_sized_on_meta_tensors():
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = ModelConfig("llama2-34b", precision="fp16")
    par = ParallelConfig(8, 8, 8, use_distributed_optimizer=True)
    rep, own = rank_tensors(model, par, pp_rank=3, dp_rank=5)
    assert all(t.device.type == "meta" for _, t in rep + own)
    # a middle stage: 6 layers, TP-sharded; fp16 weights, fp32 RMSNorm weights
    h, ffn, d = 8192, 22016, 128
    linear = h * h // 8 + (64 + 16) * d * h // 8 + 2 * ffn * h // 8 + ffn * h // 8
    assert sum(t.numel() for _, t in rep) == 6 * (linear + 2 * h)
    assert sum(t.numel() * t.element_size() for _, t in rep) == 6 * (2 * linear + 4 * 2 * h)
    # ZeRO-1: 1/8 of each buffer (fp16 weights: fp32 main + Adam, 12 bytes an element;
    # fp32 norms: Adam only, 8 bytes)
    assert sum(t.numel() * t.element_size() for _, t in own) == \
        (12 * 6 * linear + 8 * 6 * 2 * h) // 8
    p = Plan(model, par, HardwareConfig("V100"), SnapshotConfig("aec,aor"))
    # one layout per (stage, member) and scheme (none, arc, aec), not one per rank
    assert len(p._snaps) == 3 * par.pp * par.dp
    whole = model.num_parameters() + 2 * (model.padded_vocab_size(8) - 32000) * h
    norms = (2 * 48 + 1) * h  # RMSNorm weights: on every TP rank, counted there
    assert p.state_bytes == 14 * (whole - norms) + 12 * 8 * norms
    assert p.state_bytes > 470e9
    # nothing of that was allocated
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024


def test_placement_and_protection_errors_are_the_trainers():
    tiny = ModelConfig("tiny")
    bad = Plan(tiny, ParallelConfig(data_parallel_size=2, gpus_per_node=2),
               HardwareConfig("cpu"), SnapshotConfig("arc"))
    assert bad.placement_error.startswith("--reft-protect arc: sharding group (ranks [0, 1]) "
                                          "has two members in one failure domain")
    ok = Plan(tiny, ParallelConfig(data_parallel_size=2, gpus_per_node=1),
              HardwareConfig("cpu"), SnapshotConfig("arc"))
    assert ok.placement_error is None
    # the paper's Llama-1.3B TP4 PP4 DP8 fits with 4 GPUs per node, not with 8
    for gpus, valid in ((4, True), (8, False)):
        r = plan(["--model-size", "llama2-1.3b", "--tensor-model-parallel-size", "4",
                  "--pipeline-model-parallel-size", "4", "--data-parallel-size", "8",
                  "--gpus-per-node", str(gpus), "--reft-protect", "aec"])
        assert (r.plan.placement_error is None) == valid
        assert r.reliability.k == (1 if valid else 0)


def test_bubbles_tier_split_and_host_memory():
    model = ModelConfig("llama2-1.3b")
    par = ParallelConfig(4, 4, 8, gpus_per_node=4, num_microbatches=8,
                         num_layers_per_virtual_pipeline_stage=3)
    slow = HardwareConfig("A100", d2h_bandwidth=0.5e9)  # snapshots outgrow the bubbles
    p = Plan(model, par, slow, SnapshotConfig("arc"))
    for s in p.stages:
        assert s.bubble_1f1b == bubbles.bubble_time(4, s.t_fb)
        assert s.bubble_interleaved == bubbles.bubble_time(4, s.t_fb, 2)
        split = bubbles.tier_split(s.d2h_bytes, s.t_snapshot, s.bubble_interleaved)
        assert (s.bubble_bytes, s.rest_bytes) == (split.bubble_bytes, split.rest_bytes)
        assert s.rest_bytes > 0 and s.overhead > 0
    assert p.t_iter == bubbles.iteration_time(4, 8, max(s.t_fb for s in p.stages), 2)
    # host memory: two slots per rank (snapshot.py _check_memory), per node
    for scheme, factor in (("none", 1), ("arc", 2)):
        node = sum(2 * p.snapshot_of(pp, dp, scheme).slot_bytes
                   for r in p.ranks_of_node(0) for _, dp, pp in [p.par.coords(r)])
        assert p.host_memory[scheme]["bytes"] >= node
        assert math.isclose(p.host_memory[scheme]["bytes"], factor *
                            p.host_memory["none"]["bytes"], rel_tol=1e-3)
    assert p.host_memory["aec"]["bytes"] < p.host_memory["arc"]["bytes"]


def test_cli_table_json_and_plot(tmp_path, capsys):
    args = ["--model-size", "llama2-1.3b", "--tensor-model-parallel-size", "4",
            "--pipeline-model-parallel-size", "4", "--data-parallel-size", "8",
            "--gpus-per-node", "4", "--hardware", "V100", "--fp16",
            "--use-distributed-optimizer", "--reft-protect", "arc,aor",
            "--train-tokens", "1e11"]
    png = tmp_path / "plan.png"
    assert main(args + ["--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for needle in ("bubble 1F1B", "tier 1 / tier 2", "load node lost", "arc,aor",
                   "goodput", "days of compute"):
        assert needle in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["ranks"]) == 128 and len(doc["stages"]) == 4
    assert set(doc["host_memory"]) == {"none", "arc", "aec", "arc,aor", "aec,aor"}
    assert doc["reliability"]["protected_failures"] == 1
    assert doc["cost"]["compute_days"] > 0
    cmd = [sys.executable, "-m", "reft_ext.plan", "--model-size", "tiny",
           "--tensor-model-parallel-size", "3"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: --tensor-model-parallel-size: 4 attention heads "
                                  "are not divisible by TP 3")


@pytest.mark.parametrize("argv, message", [
    (["--model-size", "llama2-70b"], "--model-size: unknown preset"),
    (["--num-layers", "4"], "--hidden-size: required"),
    (["--model-size", "tiny", "--pipeline-model-parallel-size", "3"],
     "--pipeline-model-parallel-size: --num-layers 4 is not divisible by PP 3"),
    (["--model-size", "tiny", "--data-parallel-size", "0"],
     "--data-parallel-size: must be >= 1"),
    (["--model-size", "tiny", "--data-parallel-size", "2", "--global-batch-size", "5"],
     "--global-batch-size: 5 is not divisible"),
    (["--model-size", "tiny", "--reft-protect", "raid"], "--reft-protect: unknown scheme"),
    (["--model-size", "tiny", "--reft-protect", "arc"],
     "--reft-protect: arc needs --data-parallel-size >= 2"),
    (["--model-size", "tiny", "--data-parallel-size", "2", "--reft-protect", "arc,aor"],
     "--reft-protect: aor protects ZeRO-1"),
    (["--model-size", "tiny", "--hardware", "TPU"], "--hardware: unknown profile"),
    (["--model-size", "tiny", "--hardware", "custom"], "--device-flops: required"),
    (["--model-size", "tiny", "--mfu", "1.5"], "--mfu: a fraction"),
    (["--model-size", "tiny", "--node-failures-per-day", "2"],
     "--node-failures-per-day: a probability"),
    (["--model-size", "tiny", "--train-tokens", "-1"], "--train-tokens: must be > 0"),
])
def test_flag_errors_name_the_flag(argv, message):
    with pytest.raises(PlanConfigError, match="^" + message.replace("(", r"\(")):
        plan(argv)
