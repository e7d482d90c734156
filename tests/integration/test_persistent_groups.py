"""Process groups that survive a generation (reft_ext/cluster/groups.py): real processes,
a real SIGKILL, real gloo. The survivor keeps its group objects, held in a tuple, in a
closure and inside torch DDP's C++ reducer, and trains on with them after the restart; the
replacement is a new process that makes its groups afresh on the next generation's store.
The end state is bit-identical to the run without the failure."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from reft_ext.cluster import groups

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS, KILL_AT = 8, 4

pytestmark = pytest.mark.skipif(groups.native() is None, reason=groups.why_unavailable())

_WORKER = textwrap.dedent("""
    import datetime, os, signal, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from reft_ext.cluster import comm_abort, groups

    rank, gen, port, iters, kill_at, out = (int(sys.argv[1]), int(sys.argv[2]),
                                            int(sys.argv[3]), int(sys.argv[4]),
                                            int(sys.argv[5]), sys.argv[6])
    T = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    groups.register()
    dist.init_process_group(groups.BACKEND, store=dist.PrefixStore(f"g{gen}", store),
                            rank=rank, world_size=2, timeout=T)
    dp = dist.new_group([0, 1])
    groups.mark_started()
    held = (dp,)                                                  # a tuple
    agree = (lambda g: lambda t: dist.all_reduce(t, group=g))(dp)  # a closure
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # the reducer holds the group in C++; no bucket rebuild (find_unused_parameters), so a
    # fresh replica's buckets are the survivor's
    ddp = DDP(model, process_group=held[0], init_sync=gen == 0, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, it = {}, 0

    def join():  # the replica's parameters and the iteration, from rank 0, over the tuple
        global it
        for p in model.parameters():
            dist.broadcast(p.data, 0, group=held[0])
        t = torch.tensor([float(it)])
        dist.broadcast(t, 0, group=held[0])
        it = int(t.item())

    if gen > 0:
        join()
    while it < iters:
        if rank == 1 and gen == 0 and it == kill_at:
            print("KILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            t = torch.tensor([float(it)])
            agree(t)  # every rank is at the same iteration
            assert t.item() == 2 * it, t
        except RuntimeError as exc:  # the peer died: next generation, same groups
            print("FAILED", type(exc).__name__, flush=True)
            comm_abort.shutdown_peer_sockets({port})
            n = groups.reconfigure(dist.PrefixStore("g1", store), T)
            print("RECONFIGURED", n, groups.generation_of(held[0]), flush=True)
            join()
            continue
        g = torch.Generator().manual_seed(1000 * it + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP's all-reduce
        opt.step()
        losses[it] = loss.item()
        it += 1
    torch.save({"params": [p.detach() for p in model.parameters()], "losses": losses,
                "pid": os.getpid()}, out)
""")


def _run(tmp_path, tag: str, kill_at: int) -> dict:
    """Ranks 0 and 1 (and a replacement for rank 1 when it dies) on a store of our own;
    returns rank -> what it saved, plus the outputs."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")

    def start(rank, gen):
        out = tmp_path / f"{tag}-{rank}-{gen}.pt"
        p = subprocess.Popen([sys.executable, str(script), str(rank), str(gen),
                              str(store.port), str(ITERS), str(kill_at), str(out)],
                             env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        return p, out

    procs = {0: start(0, 0), 1: start(1, 0)}
    try:
        outs = {}
        if kill_at >= 0:
            p1, _ = procs[1]
            outs["victim"] = p1.communicate(timeout=120)[0]
            assert p1.returncode == -signal.SIGKILL, outs["victim"]
            procs[1] = start(1, 1)  # the replacement joins generation 1
        for rank, (p, _) in procs.items():
            outs[rank] = p.communicate(timeout=120)[0]
            assert p.returncode == 0, outs[rank][-4000:]
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
    saved = {r: torch.load(path, weights_only=True) for r, (_, path) in procs.items()}
    return {"saved": saved, "out": outs, "pids": {r: p.pid for r, (p, _) in procs.items()}}


@pytest.mark.timeout(300)
def test_groups_held_in_a_tuple_a_closure_and_ddp_train_on_across_a_restart(tmp_path):
    t0 = time.time()
    ref = _run(tmp_path, "ref", -1)
    run = _run(tmp_path, "fault", KILL_AT)
    # the fault really fired, the survivor failed over in its own process
    assert "KILL" in run["out"]["victim"]
    assert "FAILED" in run["out"][0] and "RECONFIGURED" in run["out"][0], run["out"][0]
    assert run["saved"][0]["pid"] == run["pids"][0]
    # its groups were reconfigured once (a communicator of generation 1), not remade
    n, gen = map(int, run["out"][0].split("RECONFIGURED ")[1].split()[:2])
    assert n == 2 and gen == 1, run["out"][0]
    # bit-identical: every parameter of both ranks and every loss of the survivor
    for rank in (0, 1):
        for a, b in zip(run["saved"][rank]["params"], ref["saved"][rank]["params"]):
            assert torch.equal(a, b)
    assert run["saved"][0]["losses"] == ref["saved"][0]["losses"]
    assert sorted(run["saved"][1]["losses"]) == list(range(KILL_AT, ITERS))
    assert all(run["saved"][1]["losses"][i] == ref["saved"][1]["losses"][i]
               for i in range(KILL_AT, ITERS))
    print(f"[persistent groups] {time.time() - t0:.1f} s")
