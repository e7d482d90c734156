"""Several ranks on one GPU: REFT's device paths across ranks on a machine with a single
device (tools/gpu_lease.sh runs it when one is lent; NCCL refuses two ranks on one device,
so the ranks talk over gloo with their tensors on the device, collectives gloo cannot do
on device tensors staged through host memory: megatron/training/gloo_device.py).

Two nodes of two ranks (tools/launch_nodes.py: real torchrun agents), TP 2 x DP 2 with
ZeRO-1 (the layout of tests/integration/test_nodes.py's aec,aor node loss, which is the
CPU twin), each rank's model and optimizer on the device; snapshots every iteration:

  ref          failure-free, the reference's final checkpoint
  lost-arc     --reft-protect arc,aor: rank 2 freezes at iteration 4, node 1 (ranks 2, 3)
               is lost and replaced: its slices come back from the ARC replicas (D2H on
               the survivors, H2D on the replacement), its ZeRO-1 shards from the AOR
               replicas of its device owners (verified every 3 iterations: iteration 3,
               the restored one, is exact)
  lost-aec     the same with AEC: the lost slices rebuilt from parity XORed on the device
  crash        arc,aor: rank 1 is SIGKILLed at iteration 4, torchrun restarts every
               worker, REFT-load restores each from its own host memory

Each final checkpoint is compared with the reference by tools/compare_checkpoints.py
(bit for bit); one line per case, its row added to the table in --out as it finishes
(a time limit loses only the rows not yet run). The reference shares the cases'
staging, so ``--staging-check`` checks the staging itself against a reference that
does not: two gloo ranks on the device run every staged collective (ZeRO-1's
reduce-scatter into a view of its own input among them) on device tensors and plain
gloo on host copies of the same values; the results must be bit-identical. ``--dry-run`` prints the trainer
command of every case (``+ `` lines, what tests/unit/test_gpu_multirank.py parses) and
starts nothing; ``--device cpu`` runs the same cases on gloo with host tensors.

    python tools/gpu_multirank.py --out runs/gpu-lease/multirank [--dry-run] [--device cpu]
    python tools/gpu_multirank.py --staging-check [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

NODES, PER_NODE = 2, 2
# tests/harness/run.py's TINY, N and LAYOUTS["tp2dp2-zero1"] (the CPU twin's flags)
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--log-params-hash", "--log-loss-history"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
          "--global-batch-size", "8"]
FAULT_ITER = 4       # the fault's iteration: iteration 3 is restored
VERIFY_EVERY = 3     # AOR: the restored iteration is a verified one (exact on a device)
# case -> (--reft-protect, --inject-fault, lost node or None)
CASES = {"ref": ("arc,aor", None, None),
         "lost-arc": ("arc,aor", f"2:{FAULT_ITER}:STOP", 1),
         "lost-aec": ("aec,aor", f"2:{FAULT_ITER}:STOP", 1),
         "crash": ("arc,aor", f"1:{FAULT_ITER}", None)}


def trainer_args(case: str, out: str, device: str, iters: int = 6) -> list[str]:
    protect, fault, _ = CASES[case]
    args = [*TINY, "--train-iters", str(iters), *LAYOUT,
            "--reft-snapshot-every", "1", "--reft-protect", protect,
            "--reft-aor-verify-every", str(VERIFY_EVERY),
            "--save", os.path.join(out, case, "ckpt")]
    if device == "cuda":  # every rank on the one device, gloo between them
        args += ["--distributed-backend", "gloo"]
    if fault:
        args += ["--inject-fault", fault]
    return args


def run_case(case: str, out: str, device: str, timeout: float) -> tuple[str, str]:
    """(verdict, detail) of one case: its job, its fault, its comparison."""
    from tools.launch_config import LaunchConfig
    from tools.launch_nodes import NodeLauncher

    _, fault, lost = CASES[case]
    logs = os.path.join(out, case, "logs")
    os.makedirs(logs, exist_ok=True)
    env = {"REFT_EVENTS_FILE": os.path.join(out, case, "events.jsonl")}
    L = NodeLauncher(LaunchConfig(nnodes=NODES, nproc_per_node=PER_NODE, max_restarts=2,
                                  log_dir=logs), trainer_args(case, out, device), env=env)
    t0 = time.time()
    try:
        L.start()
        if lost is not None:
            L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 2 ", timeout=timeout)
            L.kill_node(lost)
            L.replace_node(lost)
        codes = L.wait(timeout)
    except (TimeoutError, RuntimeError) as exc:
        return "FAILED", f"{type(exc).__name__}: {str(exc)[-300:]}"
    finally:  # nothing of the case outlives it (agents, workers, watchers, /dev/shm)
        text = L.outputs()
        L.close()
        L.cleanup_shm()
        with open(os.path.join(out, case, "output.log"), "w") as f:
            f.write(text)
    secs = time.time() - t0
    if any(c != 0 for c in codes.values()) and lost is None:
        return "FAILED", f"exit codes {codes} ({secs:.0f} s)"
    fired = fault is None or "[FAULT] " in text
    recovered = [line.split("[REFT] ", 1)[1][:90] for line in text.splitlines()
                 if "[REFT] recovered iteration" in line]
    if not fired or (fault and not recovered):
        return "FAILED", f"fault fired {fired}, recoveries {len(recovered)} ({secs:.0f} s)"
    return "ran", f"{secs:.0f} s; " + ("; ".join(recovered[:2]) or "no failure")


def compare(out: str, case: str) -> str:
    cmd = [sys.executable, os.path.join(REPO, "tools", "compare_checkpoints.py"),
           os.path.join(out, "ref", "ckpt"), os.path.join(out, case, "ckpt")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return "identical" if r.returncode == 0 else f"DIFFERS ({r.stdout.strip()[-200:]})"


def _staging_rank(rank: int, store: str, device: str, out: str) -> None:
    """One rank of --staging-check: each staged collective on ``device`` tensors vs the
    plain gloo collective on host copies; writes its verdicts to ``out.rank``."""
    import json

    import torch
    import torch.distributed as dist

    from megatron.training import gloo_device

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # the host twin stages every host tensor of the staged call (the reference call is
    # the plain collective): the same copies and copy-backs, no device
    stage = (lambda t: t.device.type != "cpu") if device == "cuda" else \
        (lambda t: isinstance(t, torch.Tensor))
    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(8, 4, generator=gen)

    def on(x):
        return x.to(device, copy=True)

    def zero1(mk):  # megatron-core's ZeRO-1: the output is the rank's view of its input
        buf = mk(base)
        return [buf.view(-1)[rank * 16:(rank + 1) * 16], buf.view(-1)], buf
    cases = {
        "reduce_scatter_tensor (ZeRO-1: output a view of its input)": (
            "reduce_scatter_tensor", zero1),
        "all_gather_into_tensor": ("all_gather_into_tensor",
                                   lambda mk: ([mk(torch.zeros(64)), mk(base.view(-1)[:32])],
                                               None)),
        "all_reduce": ("all_reduce", lambda mk: ([mk(base)], None)),
        "broadcast": ("broadcast", lambda mk: ([mk(base), 1], None)),
        "all_gather": ("all_gather", lambda mk: ([[mk(torch.zeros(8, 4)),
                                                   mk(torch.zeros(8, 4))], mk(base)], None)),
    }
    verdicts = {}
    try:
        for label, (name, make) in cases.items():
            fn = getattr(dist, name)
            host_args, host_buf = make(lambda x: x.clone())
            fn(*host_args)  # the reference: plain gloo on host tensors, nothing staged
            dev_args, dev_buf = make(on)
            gloo_device.staged(fn, stage)(*dev_args)
            flat = lambda a: [t for x in a if isinstance(x, (list, torch.Tensor))  # noqa: E731
                              for t in (x if isinstance(x, list) else [x])]
            same = all(torch.equal(h.cpu(), d.cpu()) for h, d in
                       zip(flat(host_args), flat(dev_args)))
            if host_buf is not None:
                same &= torch.equal(host_buf.cpu(), dev_buf.cpu())
            verdicts[label] = same
        with open(f"{out}.{rank}", "w") as f:
            json.dump(verdicts, f)
    finally:
        dist.destroy_process_group()


def staging_check(device: str, out: str) -> int:
    """--staging-check: two gloo ranks, staged vs plain (see the module's doc)."""
    import json

    import torch.multiprocessing as mp

    os.makedirs(out, exist_ok=True)
    res = os.path.join(out, "staging")
    mp.spawn(_staging_rank, args=(os.path.join(out, "staging.store"), device, res),
             nprocs=2, join=True)
    ok = True
    for rank in (0, 1):
        for label, same in json.load(open(f"{res}.{rank}")).items():
            ok &= same
            print(f"[multirank] staging rank {rank} {label}: "
                  f"{'identical to plain gloo on host' if same else 'DIFFERS'}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="where the cases' checkpoints, logs and "
                   "table go (default: a new temporary directory)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, ref first")
    p.add_argument("--timeout", type=float, default=150, help="seconds per case")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--staging-check", action="store_true",
                   help="check the staged collectives against plain gloo on host tensors")
    a = p.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad or cases[:1] != ["ref"]:
        p.error(f"--cases: from {list(CASES)}, ref first; got {a.cases!r}")
    out = a.out or tempfile.mkdtemp(prefix="gpu-multirank-")
    if a.staging_check and a.dry_run:
        print("+ " + shlex.join(["tools/gpu_multirank.py", "--staging-check", "--device",
                                 a.device, "--out", out]))
        return 0
    if a.staging_check:
        return staging_check(a.device, out)
    if a.dry_run:
        for c in cases:
            print(f"# {c}: {NODES} nodes x {PER_NODE} ranks on one {a.device} device")
            print("+ " + shlex.join(["pretrain_llama.py", *trainer_args(c, out, a.device)]))
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_multirank: no CUDA device here (use --device cpu for the CPU twin)",
                  file=sys.stderr)
            return 2
    # gpu_lease.sh's time limit (SIGTERM): the running case's launcher is closed first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    rows, ok = [], True
    for c in cases:
        verdict, detail = run_case(c, out, a.device, a.timeout)
        same = compare(out, c) if c != "ref" and verdict == "ran" else "-"
        ok &= verdict == "ran" and same in ("identical", "-")
        rows.append(f"| {c} | {CASES[c][0]} | {CASES[c][1] or '-'} | {verdict} | {same} | "
                    f"{detail} |")
        print(f"[multirank] {c}: {verdict}, {same}: {detail}", flush=True)
        table = ["| case | protect | fault | run | vs ref (compare_checkpoints) | detail |",
                 "|---|---|---|---|---|---|", *rows]
        with open(os.path.join(out, "table.md"), "w") as f:  # each row as it finishes
            f.write("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
