"""The planner (issue 8): its per-rank bytes and placement match a real run's snapshot
manifests, it sizes a 34B model on meta tensors, and its flags fail with one-line errors
naming the flag."""

import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
from tests.harness.run import REPO, torchrun

from reft_ext.plan import PlanConfigError, plan
from reft_ext.plan.cli import main
from reft_ext.plan.hardware import HardwareConfig
from reft_ext.plan.model import ModelConfig, ParallelConfig
from reft_ext.plan.planner import Plan, SnapshotConfig
from reft_ext.plan.presets import MODEL_PRESETS, fill_model_shape, llama_ffn_hidden_size
from reft_ext.plan.state import rank_tensors
from reft_ext.store.paths import node_glob

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--vocab-size", "128"]
# every path of the state derivation at once: two model chunks per stage (interleaved),
# the embedding and the output layer on different stages, bf16 params with fp32 norms
# (two DDP buffers per chunk), ZeRO-1 shards that cut parameters, ARC
LAYOUT = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
          "1", "--use-distributed-optimizer", "--bf16", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--reft-protect", "arc"]


@pytest.mark.slow  # make test's 12 minutes; the planner's default-tier checks are the
# unit tests below and tests/unit/test_plan_*.py
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
    manifests = sorted(glob.glob(os.path.join(node_glob(str(shm), job), "rank*.slot*.json")))
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
    assert arguments.fill_model_shape is fill_model_shape  # one resolution of --model-size
    # 2/3 of 4h rounded up to 256: Llama-2-7B's 11008, and the widths of the other presets
    assert [llama_ffn_hidden_size(h) for h in [64, 2048, 2560, 4096, 8192]] == \
        [256, 5632, 6912, 11008, 22016]


def _rss_kib() -> int:
    """This process's resident memory now (VmRSS), in KiB. Not ru_maxrss: a high-water
    mark cannot see growth below a peak an earlier test of the session left behind."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_34b_state_is_sized_on_meta_tensors():
    rss = _rss_kib()
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
    # nothing of that was allocated (the plan and the tensors are still alive here)
    assert _rss_kib() - rss < 200 * 1024


def test_placement_and_protection_errors_are_the_trainers():
    tiny = ModelConfig("tiny")
    bad = Plan(tiny, ParallelConfig(data_parallel_size=2, gpus_per_node=2),
               HardwareConfig("cpu"), SnapshotConfig("arc"))
    assert bad.placement_error.startswith("--reft-protect arc: sharding group (ranks [0, 1], "
                                          "nodes [0, 0]) lives on one failure domain")
    ok = Plan(tiny, ParallelConfig(data_parallel_size=2, gpus_per_node=1),
              HardwareConfig("cpu"), SnapshotConfig("arc"))
    assert ok.placement_error is None
    # the paper's Llama-1.3B TP4 PP4 DP8 fits with 4 GPUs per node, not with 8
    # the paper's Llama-1.3B TP4 PP4 DP8: with 4 GPUs per node each sharding group spans
    # 8 nodes; with 8 two members share a node and the group spans 4 (placed across them)
    for gpus, group_nodes in ((4, 8), (8, 4)):
        r = plan(["--model-size", "llama2-1.3b", "--tensor-model-parallel-size", "4",
                  "--pipeline-model-parallel-size", "4", "--data-parallel-size", "8",
                  "--gpus-per-node", str(gpus), "--reft-protect", "aec"])
        assert r.plan.placement_error is None
        assert r.reliability.k == 1 and r.reliability.group == group_nodes
    # a group within one node (PP 2 x DP 2 on nodes of 2): refused, not protected
    r = plan(["--model-size", "tiny", "--pipeline-model-parallel-size", "2",
              "--data-parallel-size", "2", "--gpus-per-node", "2", "--reft-protect", "arc"])
    assert "lives on one failure domain" in r.plan.placement_error and r.reliability.k == 0


def test_bubbles_tier_split_and_host_memory():
    """Llama-2-1.3B (h 2048, s 4096, 32 heads = query groups, ffn 5632, vocab 32000 padded
    to 32256 for TP 4), TP4 PP4 DP8, micro-batch 1 x 8, v = 2 chunks per stage, bf16,
    ARC, A100 (312e12 FLOP/s x MFU 0.45, host 300e9 B/s) with a slow D2H of 0.5e9 B/s so
    the snapshots outgrow the bubbles. Every expected number is worked out by hand from
    the formulas of docs/planner.md and reft_ext/save/bubbles.py, not by the planner."""
    model = ModelConfig("llama2-1.3b")
    par = ParallelConfig(4, 4, 8, gpus_per_node=4, num_microbatches=8,
                         num_layers_per_virtual_pipeline_stage=3)
    slow = HardwareConfig("A100", d2h_bandwidth=0.5e9)  # snapshots outgrow the bubbles
    p = Plan(model, par, slow, SnapshotConfig("arc"))
    # t_fb = FLOPs / TP / (peak x MFU); a layer: 12 s h^2 (1 + g/a + s/h + 1.5 ffn/h) =
    # 12 x 4096 x 2048^2 x 8.125 = 1675037245440
    t_mid = 0.017895697066666667  # 6 layers: 10050223472640 / 4 / 140.4e12
    t_last = 0.02076359723760684  # + logits 6 s h V = 1610612736000: 11660836208640 / 4 / 140.4e12
    # slot = own slice + ARC replica = 2 x replicated / 8; replicated = 14 B per bf16
    # element (param 2 + fp32 main, m, v) + 12 B per fp32 norm element (param 4 + m, v);
    # per layer 12845056 bf16 + 4096 fp32, embedding / output layer 8064 x 2048 = 16515072
    slot_end = 327628800  # last: 2 x (14 x (6 x 12845056 + 16515072) + 12 x (6 x 4096 + 2048)) / 8
    slot_first = 327622656  # first: 2 x (14 x 93585408 + 12 x 24576) / 8 = 2 x 1310490624 / 8
    slot_mid = 269819904  # middle: 2 x (14 x 77070336 + 12 x 24576) / 8 = 2 x 1079279616 / 8
    expect = [  # (t_fb, D2H bytes = slot, tier 1 = floor(D2H x T_bubble / T_snapshot) to 64 B)
        (t_mid, slot_first, 13421760),  # floor(0.5e9 x 1.5 t_fb = 13421772.8) // 64 x 64
        (t_mid, slot_mid, 13421760),  # the same bubble: T_bubble x BW_io = 13421772.8 B
        (t_mid, slot_mid, 13421760),
        (t_last, slot_end, 15572672),  # floor(0.5e9 x 1.5 t_last = 15572697.9) // 64 x 64
    ]
    for s, (t_fb, d2h, tier1) in zip(p.stages, expect):
        assert s.t_fb == pytest.approx(t_fb, rel=1e-12)
        assert s.bubble_1f1b == pytest.approx(3 * t_fb, rel=1e-12)  # (P - 1) t_fb
        assert s.bubble_interleaved == pytest.approx(1.5 * t_fb, rel=1e-12)  # (P - 1) t_fb / v
        assert s.d2h_bytes == s.slot_bytes == d2h
        assert s.t_snapshot == pytest.approx(d2h / 0.5e9, rel=1e-12)  # size / BW_io
        assert (s.bubble_bytes, s.rest_bytes) == (tier1, d2h - tier1)
        # tier 2 (rest / BW_io) outlasts compute (8 t_fb): interference 0.05 x compute plus
        # the excess; host time 4 x D2H / 300e9 < 1 ms fits the iteration
        assert s.overhead == pytest.approx((d2h - tier1) / 0.5e9 - 0.95 * 8 * t_fb, rel=1e-9)
    # 314200896 / 0.5e9 - 0.95 x 8 x t_mid = 0.628401792 - 0.136007298
    assert p.stages[0].overhead == pytest.approx(0.49239449429333, rel=1e-9)
    assert p.t_iter == pytest.approx(0.19725417375726498, rel=1e-12)  # (m + (P-1)/v) t_last
    # host memory of the largest node (4 ranks of the last stage, three slots each:
    # --reft-keep's default, local commits): 4 x 3 x the slot
    assert p.host_memory["none"]["bytes"] == 12 * 163814400  # own slice
    assert p.host_memory["arc"]["bytes"] == 12 * 327628800  # own slice + its replica
    # AEC: stream padded to 64 x 8 x 7 = 3584 B: 1310518272, slice 163814784 + parity / 7
    assert p.host_memory["aec"]["bytes"] == 12 * (163814784 + 23402112)


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
