"""Several ranks on one GPU (tools/gpu_multirank.py, a step of tools/gpu_lease.sh), what of
it runs without a device: its dry run's trainer commands go through the trainer's parser
and whole validation as a node of one CUDA device with two gloo ranks would judge them;
its flags are the CPU twin's (tests/integration/test_nodes.py's aec,aor node loss,
TP2 x DP2 with ZeRO-1 on 2 nodes of 2 ranks); and the staging of device tensors through
host memory for gloo (megatron/training/gloo_device.py) gives the collectives' results
on two real gloo ranks, inside megatron-core's coalescing manager too, with host tensors
standing in for device ones (marked by the predicate the device path replaces)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.training.arguments import build_parser, validate_args
from megatron.training.device_facts import DeviceFacts
from reft_ext.config import ReftConfig
from tests.harness.run import LAYOUTS, REPO, TINY
from tests.harness.recovery import N

SCRIPT = os.path.join(REPO, "tools", "gpu_multirank.py")
LEASE = os.path.join(REPO, "tools", "gpu_lease.sh")


def _dry_run(tmp_path, *extra, env=None) -> dict[str, list[str]]:
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path), *extra],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 0, r.stderr
    cases, name = {}, None
    for line in r.stdout.splitlines():
        if line.startswith("# "):
            name = line[2:].split(":")[0]
        elif line.startswith("+ "):
            cmd = shlex.split(line[2:])
            assert cmd[0] == "pretrain_llama.py"
            cases[name] = cmd[1:]
    assert not os.listdir(tmp_path), "a dry run must not run anything"
    return cases


def test_dry_run_commands_pass_the_trainers_validation_on_one_gpu(tmp_path, monkeypatch):
    cases = _dry_run(tmp_path)
    assert list(cases) == ["ref", "lost-arc", "lost-aec", "crash"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes x 2 ranks, all on cuda:0
    facts = DeviceFacts("cuda", 1, None, "torch", "TransformerEngine not installed")
    for name, argv in cases.items():
        args = build_parser().parse_args(argv)
        args.world_size = 4
        validate_args(args, facts)  # gloo: two ranks on one device are allowed
        cfg = ReftConfig.from_args(args)
        assert args.distributed_backend == "gloo" and args.use_distributed_optimizer
        assert (args.tensor_model_parallel_size, args.data_parallel_size) == (2, 2)
        assert cfg.enabled and cfg.aor and cfg.aor_verify_every == 3
        if name != "ref":  # the restored iteration (fault's - 1) is a verified one
            it = int(args.inject_fault.split(":")[1])
            assert (it - 1) % cfg.aor_verify_every == 0
    assert ReftConfig.from_args(build_parser().parse_args(cases["lost-aec"])).redundancy == "aec"
    assert cases["crash"][cases["crash"].index("--inject-fault") + 1] == "1:4"
    # with NCCL the same node is refused: one device, two ranks
    nccl = build_parser().parse_args(cases["ref"] + ["--distributed-backend", "nccl"])
    nccl.world_size = 4
    with pytest.raises(ValueError, match="^--nproc-per-node: 2 ranks per node, 1 GPU"):
        validate_args(nccl, facts)


def test_the_device_cases_are_the_cpu_twins_layout(tmp_path):
    """The CPU twin (test_nodes.py's aec,aor node loss, bit-exact) runs TINY + N +
    tp2dp2-zero1 on 2 nodes x 2 ranks with rank 2 frozen at iteration 4 and node 1 lost:
    the device cases run those flags (plus their own checkpoint, interval and backend)."""
    import tools.gpu_multirank as gm

    argv = _dry_run(tmp_path, "--device", "cpu")["lost-aec"]
    for flag_list in (TINY, N, LAYOUTS["tp2dp2-zero1"]):
        for i in range(0, len(flag_list), 1):
            if flag_list[i].startswith("--"):
                j = argv.index(flag_list[i])
                nxt = flag_list[i + 1] if i + 1 < len(flag_list) else "--"
                if not nxt.startswith("--"):
                    assert argv[j + 1] == nxt, flag_list[i]
    assert (gm.NODES, gm.PER_NODE) == (2, 2) and "--distributed-backend" not in argv
    assert argv[argv.index("--inject-fault") + 1] == "2:4:STOP"


def test_gpu_lease_runs_the_step_and_its_dry_run_prints_it(tmp_path):
    text = open(LEASE).read()
    assert "gpu_multirank.py" in text
    r = subprocess.run(["bash", LEASE], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, GPU_LEASE_DRY_RUN="1", OUT=str(tmp_path / "o"),
                                PYTHON=sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ pretrain_llama.py")]
    assert len(lines) == 4, r.stdout


# ---- staging device tensors through host memory for gloo -------------------------------
def _staging(rank: int, store: str, out: str) -> None:
    from megatron.training import gloo_device

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        marked: set = set()
        calls = []

        def predicate(t):
            hit = id(t) in marked
            if hit:
                calls.append(1)
            return hit

        def both(name, make, *rest, **kw):
            """(native result, staged result) of one collective on fresh tensors."""
            res = []
            for stage in (False, True):
                ts = make()
                fn = getattr(dist, name)
                if stage:
                    for t in ts:
                        (marked.update(id(x) for x in t) if isinstance(t, list)
                         else marked.add(id(t)))
                    fn = gloo_device.staged(fn, predicate)
                w = fn(*ts, *rest, **kw)
                if kw.get("async_op"):
                    w.wait()
                res.append([x.tolist() for t in ts for x in (t if isinstance(t, list) else [t])])
            return res

        gen = lambda n: (torch.arange(n, dtype=torch.float32) + 10 * rank)  # noqa: E731
        results = {
            "reduce_scatter_tensor": both("reduce_scatter_tensor",
                                          lambda: [torch.empty(4), gen(8)]),
            "all_gather_into_tensor": both("all_gather_into_tensor",
                                           lambda: [torch.empty(8), gen(4)], async_op=True),
            "all_reduce": both("all_reduce", lambda: [gen(5)], async_op=True),
            "all_gather": both("all_gather", lambda: [[torch.empty(3), torch.empty(3)],
                                                      gen(3)]),
            "broadcast": both("broadcast", lambda: [gen(4)], 1),
        }
        # inside the coalescing manager megatron-core's DDP wraps its reduce-scatters in
        out_t, in_t = torch.empty(4), gen(8)
        marked.update({id(out_t), id(in_t)})
        rs = gloo_device.staged(dist.reduce_scatter_tensor, predicate)
        with dist._coalescing_manager(async_ops=True) as cm:
            handle = rs(out_t, in_t, async_op=True)
        cm.wait()
        results["coalesced"] = [out_t.tolist(), results["reduce_scatter_tensor"][0][0]]
        results["handle_done"] = handle.is_completed()
        results["staged_calls"] = len(calls)
        # sequence parallelism's mappings call megatron-core's own aliases
        # (tensor_parallel.mappings.dist_*_func): staged once install() swapped them
        from megatron.core.tensor_parallel import mappings
        from megatron.training import cpu_compat

        cpu_compat.apply()  # (mappings allocate on torch.cuda.current_device())
        group = dist.group.WORLD
        sp = []
        for stage in (False, True):
            if stage:
                gloo_device.install(predicate=lambda t: isinstance(t, torch.Tensor))
            before = sum(gloo_device.staged_calls.values())
            try:
                x = gen(8).reshape(4, 2)
                sp.append([mappings._reduce_scatter_along_first_dim(x, group).tolist(),
                           mappings._gather_along_first_dim(x, group).tolist(),
                           mappings._reduce(x.clone(), group).tolist(),
                           sum(gloo_device.staged_calls.values()) - before])
            finally:
                gloo_device.uninstall()
        results["sp"] = sp
        with open(f"{out}.{rank}", "w") as f:
            json.dump(results, f)
        # both ranks done with every collective before either tears gloo down: once in
        # a fresh-clone CI run rank 0 ended by SIGABRT ("terminate called without an
        # active exception") as its peer destroyed the group
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_staged_collectives_give_the_native_results_on_two_gloo_ranks(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_staging, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in (0, 1):
        res = json.load(open(f"{out}.{rank}"))
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce",
                     "all_gather", "broadcast"):
            native, staged = res[name]
            assert native == staged, (rank, name)
        assert res["coalesced"][0] == res["coalesced"][1] and res["handle_done"]
        assert res["staged_calls"] > 0  # the staging path really ran
        plain, staged = res["sp"]
        assert plain[:3] == staged[:3] and plain[3] == 0 and staged[3] == 3, res["sp"]
        if rank == 0:  # its rows summed over both ranks, not its own
            assert staged[0] == [[10.0, 12.0], [14.0, 16.0]], staged[0]


def test_staging_check_against_plain_gloo_on_host(tmp_path):
    """gpu_multirank.py --staging-check (the lease's reference that shares no staging):
    on this host its twin stages host tensors; every collective, ZeRO-1's reduce-scatter
    into a view of its own input among them, equals plain gloo on both ranks."""
    r = subprocess.run([sys.executable, SCRIPT, "--staging-check", "--device", "cpu",
                        "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[multirank] staging")]
    assert len(lines) == 10 and all("identical to plain gloo on host" in ln for ln in lines)
    assert sum("ZeRO-1" in ln for ln in lines) == 2
