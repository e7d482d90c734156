"""AOR's replay of a step waits for the holder's next pipeline bubble (reft_ext/protect/aor/
transport.py ``defer_to_bubbles``, issue 57): two real gloo ranks, each the owner of an
Adam shard and the holder of the other's replica. A step's message is received but not
applied until the holder waits on pipeline communication (``bubble()``, what the
PipelineEvents listener calls), its next optimizer step, or a reader; the replica stays
bit-identical to its owner, and a transport stopped while a replay waits stops."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 4
SETTLE_S = 0.3  # long enough for a message to land and an allowed replay to run


def _pair(rank: int, store: str, out: str) -> None:
    from reft_ext.protect.aor.transport import AORTransport

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        gen = torch.Generator().manual_seed(rank)
        p = torch.nn.Parameter(torch.randn(1 << 14, generator=gen))
        opt = torch.optim.Adam([p], lr=1e-3)
        aor = AORTransport([opt], group)
        aor.defer_to_bubbles = True
        aor.initialize()
        aor.wait()
        seen = []  # per step: replays applied after the step, then after a bubble
        for i in range(STEPS):
            p.grad = torch.randn(p.shape, generator=gen)
            dist.barrier(group=group)
            opt.step()
            time.sleep(SETTLE_S)
            after_step = aor.replica.applied
            if i % 2:  # a bubble on odd steps; on even ones the next step lets it run
                aor.bubble()
                time.sleep(SETTLE_S)
            seen.append([after_step, aor.replica.applied])
        check = aor.verify(iteration=STEPS)
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()  # a replay left waiting for a bubble ...
        time.sleep(SETTLE_S)
        waiting = aor.replica.applied
        t0 = time.perf_counter()
        stopped = aor.abandon(timeout_s=5.0)  # ... does not hold the stop
        res = {"seen": seen, "match": bool(check["match"]), "valid": bool(check["valid"]),
               "waiting": waiting, "stopped": stopped, "stop_s": time.perf_counter() - t0}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def test_a_step_is_replayed_in_the_next_bubble_and_stays_bit_identical(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_pair, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in (0, 1):
        r = json.load(open(f"{out}.{rank}"))
        # step i's message waits (i replays done: the earlier ones, let run at the
        # latest by step i itself); a bubble after it lets it run
        assert [a for a, _ in r["seen"]] == list(range(STEPS)), r
        assert [b for _, b in r["seen"]] == [0, 2, 2, 4], r
        assert r["match"] and r["valid"], r  # the owner's exact bytes
        assert r["waiting"] == STEPS, r  # verify() applied all; the last step's waits
        assert r["stopped"] and r["stop_s"] < 2.0, r
