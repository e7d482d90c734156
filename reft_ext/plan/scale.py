"""What REFT costs per iteration as the job grows (issue 34, docs/scale.md): the
collectives REFT issues on the training path by group size, the contention of the
snapshot copy with training for the host link and host memory, AOR's inter-node
gradient traffic, and REFT-load with its job-wide agreement, at world sizes W where TP x
PP stays and DP grows (weak scaling: each replica keeps its micro-batches, so the
iteration time stays).

The inventory of collectives is the code's, counted on a real job by
tests/integration/test_reft_collectives.py: the loss-spike verdict over the pipeline
group (+ data parallel without the distributed optimizer), the snapshot line's
statistics over the job once per ``--log-interval``, the commit over the job only with
``--reft-keep 2`` (reft_ext/store/commit.py), AOR's gradient shard to its holder on the
next node. A small gloo all-reduce over TCP runs a ring: 2 (n - 1) steps of
``--collective-latency`` each.

Contention, the planner's model (docs/planner.md "At scale"): the snapshot's
device-to-host copy shares the host link with the training's inter-node traffic where a
node's GPUs and NICs sit under the same PCIe switches (DGX), and the node's memory
bandwidth with everything else on the host. A transfer that shares a link with another
one is delayed by the shorter of the two; the snapshot's host-memory traffic is charged
in full (``--host-interference``). Neither is hidden in bubbles: the bubbles are where
the copy runs, not where the link is idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from reft_ext.plan.common import fail, positive
from reft_ext.plan.common import flag_field as _f

# per profile: does the D2H copy share the PCIe switch with the node's NICs; seconds per
# ring step of a small gloo all-reduce between nodes (TCP over the cluster network)
LINK_SHARED = {"V100": True, "A100": True, "H100": True, "MI250X": False, "cpu": False}
INVENTORY_BYTES = 512  # one rank's pickled REFT-load inventory (a few slots' iterations)
HASH_BANDWIDTH = 10e9  # xxh3 bytes/s of one thread, measured here (docs/planner.md)


@dataclass
class ScaleConfig:
    """REFT at scale: which world sizes, and the figures the model needs beyond the
    hardware profile (names as the trainer's flags where they are its flags)."""

    world_sizes: str = _f("", "also model REFT's cost per iteration at these world sizes, "
                              "e.g. 512,4096,16384 (DP grows, TP x PP stays)")
    log_interval: int = _f(100, "--log-interval: the snapshot line's job-wide statistics "
                                "are gathered once per this many iterations")
    rollback_on: str = _f("nan", "--reft-rollback-on: off, or the verdict is agreed over the "
                                 "pipeline group every iteration", "--reft-rollback-on")
    collective_latency: float = _f(30e-6, "seconds per ring step of a small gloo "
                                          "all-reduce between nodes (TCP)")
    link_shared: str = _f("auto", "does the D2H copy share the host link with the NICs: "
                                  "yes, no, auto (the profile: DGX yes, Frontier no)")
    host_interference: float = _f(1.0, "fraction of the snapshot's host-memory time that "
                                       "delays training (0 = fully hidden)")
    iteration_seconds: float = _f(0.0, "a measured iteration time instead of the FLOP "
                                       "model's (0 = the model's)")

    def __post_init__(self):
        positive(ScaleConfig, self, "log_interval", "collective_latency")
        if self.link_shared not in ("yes", "no", "auto"):
            fail("--link-shared", f"yes, no or auto, got {self.link_shared!r}")
        if not 0 <= self.host_interference <= 1:
            fail("--host-interference", f"a fraction in [0, 1], got {self.host_interference}")
        try:
            self.sizes = [int(w) for w in self.world_sizes.split(",") if w.strip()]
        except ValueError:
            fail("--world-sizes", f"comma-separated rank counts, got {self.world_sizes!r}")

    def shared(self, hardware: str) -> bool:
        return LINK_SHARED.get(hardware, False) if self.link_shared == "auto" else \
            self.link_shared == "yes"


def ring_allreduce(n: int, nbytes: int, latency: float, bandwidth: float) -> float:
    """gloo's ring all-reduce of a small tensor over n ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def reft_collectives(plan, cfg: ScaleConfig, world: int, dp: int,
                     keep: int | None = None) -> list[dict]:
    """Every collective REFT adds per iteration at this size: what, group, bytes, how
    many per iteration, seconds each, on the training thread or not (``keep``: the
    --reft-keep to model, default the plan's)."""
    par, hw = plan.par, plan.hw
    every = plan.snap.snapshot_every
    nic = hw.network_bandwidth / par.ranks_per_node  # one rank's share of the node's NICs
    out = []

    def add(what, group, n, nbytes, per_iter, on_path=True, seconds=None):
        t = ring_allreduce(n, nbytes, cfg.collective_latency, nic) if seconds is None \
            else seconds
        out.append({"what": what, "group": group, "group_size": n, "bytes": nbytes,
                    "per_iteration": per_iter, "seconds": t, "training_thread": on_path})

    if (keep or plan.snap.keep_for(world // plan.par.ranks_per_node)) < 3:
        add("snapshot commit (store/commit.py)", "world", world, 8, 1 / every)
    add("snapshot line's slowest-rank times", "world", world, 16,
        1 / (every * cfg.log_interval))
    if cfg.rollback_on != "off":
        add("loss-spike/NaN verdict", "pipeline", par.pp, 32, 1.0)
        if not par.use_distributed_optimizer:
            add("loss-spike/NaN verdict", "data parallel", dp, 32, 1.0)
    if plan.snap.aor:
        shard = _shard_bytes(plan, dp)
        # posted after the step, received by the holder's thread: off the training thread
        add("AOR gradient shard to its holder (next node)", "p2p", 2, shard, 1.0,
            on_path=False, seconds=cfg.collective_latency + par.ranks_per_node * shard
            / hw.network_bandwidth)
    return out


def _shard_bytes(plan, dp: int) -> int:
    """A rank's fp32 gradient shard at data-parallel size dp (ZeRO-1: 1/dp of the stage)."""
    base = max(plan.snapshot_of(p, 0).param_shard_numel for p in range(plan.par.pp))
    return int(4 * base * plan.par.dp / dp)


def at_scale(plan, cfg: ScaleConfig, world: int, keep: int | None = None) -> dict:
    """REFT's per-iteration cost and REFT-load at ``world`` ranks (TP x PP of ``plan``;
    ``keep``: the --reft-keep to model, default the plan's)."""
    par, hw = plan.par, plan.hw
    mp = par.tp * par.pp
    if world % mp:
        fail("--world-sizes", f"{world} is not a multiple of TP x PP = {mp}")
    dp = world // mp
    scale = par.dp / dp  # per-rank slices and shards shrink with DP
    t_iter = cfg.iteration_seconds or plan.t_iter
    calls = reft_collectives(plan, cfg, world, dp, keep)
    on_path = sum(c["seconds"] * c["per_iteration"] for c in calls if c["training_thread"])
    s = max(plan.stages, key=lambda x: x.d2h_bytes)
    d2h = s.d2h_bytes * scale  # slice, redundancy, owned shard, AOR's: all 1/DP
    t_copy = d2h / hw.d2h_bandwidth
    # the training's inter-node traffic through the same link: the DP gradient reduction
    # (fp32 gradients, ring: 2 (D-1)/D of them), one rank's share of the node's NICs
    grads = 4 * s.params
    t_comm = 2 * (dp - 1) / dp * grads / (hw.network_bandwidth / par.ranks_per_node)
    link = min(t_copy, t_comm) if cfg.shared(hw.hardware) else 0.0
    host = cfg.host_interference * par.ranks_per_node * d2h / hw.host_memory_bandwidth
    contention = max(link, host) / plan.snap.snapshot_every
    aor = [c for c in calls if c["training_thread"] is False]
    crash, lost = _reload(plan, cfg, world, dp, scale)
    return {"world_size": world, "dp": dp, "nodes": world // par.ranks_per_node,
            "iteration_s": t_iter, "collectives": calls,
            "world_collectives_per_iteration": sum(c["per_iteration"] for c in calls
                                                   if c["group"] == "world"),
            "collectives_s": on_path, "d2h_bytes": int(d2h), "link_s": link, "host_s": host,
            "contention_s": contention, "tier2_s": max(x.overhead for x in plan.stages),
            "overhead": (on_path + contention + max(x.overhead for x in plan.stages))
            / t_iter,
            "aor_bytes_per_node": int(par.ranks_per_node * aor[0]["bytes"]) if aor else 0,
            "aor_nic_fraction": aor[0]["seconds"] / t_iter if aor else 0.0,
            "load_crash_s": crash, "load_node_lost_s": lost}


def _reload(plan, cfg: ScaleConfig, world: int, dp: int, scale: float):
    """REFT-load at this size: the byte movement of Plan._load_times (slices shrink with
    DP, the state a rank writes back does not), its own slot's checksums, and the
    agreement over the job: a barrier, the commit pointers, the inventories (an
    all-gather of W of them), the received-data check and the timing line."""
    hw, par = plan.hw, plan.par
    lat, nic = cfg.collective_latency, hw.network_bandwidth / par.ranks_per_node
    agree = 4 * ring_allreduce(world, 16, lat, nic) + \
        (world - 1) * (lat + INVENTORY_BYTES / nic)
    s = max(plan.stages, key=lambda x: x.slot_bytes)
    verify = (s.slot_bytes * scale) / HASH_BANDWIDTH
    crash = plan.load_crash + verify + agree
    lost = plan.load_node_lost
    return crash, (None if lost is None else lost + verify + agree)


def paper_checks() -> list[dict]:
    """The paper's reported figures, each with the planner flags of its set-up
    (docs/planner.md "At scale" gives the assumptions)."""
    v100 = ["--model-size", "llama2-34b", "--fp16", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "8", "--data-parallel-size", "8",
            "--num-microbatches", "32", "--hardware", "V100", "--reft-protect", "arc"]
    frontier = ["--model-size", "llama2-34b", "--tensor-model-parallel-size", "8",
                "--pipeline-model-parallel-size", "4", "--data-parallel-size", "16",
                "--use-distributed-optimizer", "--global-batch-size", "256",
                "--hardware", "MI250X", "--iteration-seconds", "6.26"]
    small = ["--model-size", "llama2-1.3b", "--fp16", "--tensor-model-parallel-size", "4",
             "--pipeline-model-parallel-size", "4", "--data-parallel-size", "8",
             "--gpus-per-node", "4", "--hardware", "V100"]
    return [
        {"figure": "ARC overhead, Llama-2-34B on 512 V100", "paper": 0.01, "unit": "fraction",
         "argv": v100, "key": "overhead"},
        {"figure": "ARC overhead, Frontier (6.32 s vs 6.26 s)", "paper": 6.32 / 6.26 - 1,
         "unit": "fraction", "argv": frontier + ["--reft-protect", "arc"], "key": "overhead"},
        {"figure": "AOR overhead, Frontier (ZeRO-1)", "paper": 0.006, "unit": "fraction",
         "argv": frontier + ["--reft-protect", "arc,aor"], "key": "overhead"},
        {"figure": "REFT-load ARC, Llama-1.3B TP4 PP4 DP8", "paper": 0.84, "unit": "s",
         "argv": small + ["--reft-protect", "arc"], "key": "load_crash_s"},
        {"figure": "REFT-load AEC, Llama-1.3B TP4 PP4 DP8", "paper": 0.75, "unit": "s",
         "argv": small + ["--reft-protect", "aec"], "key": "load_crash_s"},
    ]


# ---- output --------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return "-" if s is None else (f"{s:.2f} s" if s >= 1 else f"{1e3 * s:.1f} ms")


def scale_table(plan, cfg: ScaleConfig, rows: list[dict]) -> str:
    """One line per world size; beside it what --reft-keep 2's job-wide commit would add."""
    head = (f"REFT at scale (TP {plan.par.tp} x PP {plan.par.pp}, DP grows; "
            f"--reft-keep {plan.snap.keep or 'auto (3 above 16 nodes)'}, "
            f"--log-interval {cfg.log_interval}, "
            f"{1e6 * cfg.collective_latency:.0f} us per ring step):\n\n"
            "| ranks | DP | REFT collectives on the training thread / iteration "
            "(world-wide) | their time | contention (link, host memory) | overhead | "
            "with --reft-keep 2 | AOR per node / step (NIC) | REFT-load crash / lost node |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        n = sum(c["per_iteration"] for c in r["collectives"] if c["training_thread"])
        wide = r["world_collectives_per_iteration"]
        k2 = at_scale(plan, cfg, r["world_size"], keep=2)
        aor = (f"{r['aor_bytes_per_node'] / 1e6:.0f} MB ({r['aor_nic_fraction']:.1%})"
               if r["aor_bytes_per_node"] else "-")
        lines.append(
            f"| {r['world_size']} | {r['dp']} | {n:.2f} ({wide:.2f}) "
            f"| {_ms(r['collectives_s'])} | {_ms(r['link_s'])}, {_ms(r['host_s'])} | "
            f"{r['overhead']:.2%} | {k2['overhead']:.2%} (+{_ms(k2['collectives_s'])}) | "
            f"{aor} | {_ms(r['load_crash_s'])} / {_ms(r['load_node_lost_s'])} |")
    return "\n".join(lines)


def paper_table(results: list[dict]) -> str:
    lines = ["The paper's figures (docs/planner.md \"At scale\" gives each set-up):\n",
             "| figure | paper | planner | within 20% |", "|---|---|---|---|"]
    for r in results:
        fmt = (lambda v: f"{v:.2%}") if r["unit"] == "fraction" else (lambda v: f"{v:.2f} s")
        ok = abs(r["planner"] - r["paper"]) <= 0.2 * r["paper"]
        lines.append(f"| {r['figure']} | {fmt(r['paper'])} | {fmt(r['planner'])} | "
                     f"{'yes' if ok else 'no'} |")
    return "\n".join(lines)
