"""The control plane's downtime per failure at W ranks, from what
benchmarks/bench_control_plane.py measured on REFT's own recovery code with simulated
ranks (docs/scale.md "Recovery at scale"): the planner's recovery time at the
--world-sizes, not a constant.

Per phase of an in-process recovery (a node lost, a warm spare node taking its ranks):

* store phases (abort, rendezvous, process groups, the first iteration's marks): a
  rank's own store ops times a round trip, plus every rank's ops times the store
  server's per-op cost (one server: the shared resource). Ops per rank are the bench's
  fits a*W^k (after the cuts: O(1) per rank);
* collectives over the job (modelled, gloo's ring): the start-up agreement (the
  watcher pids' all-gather and the identity check: 3 all-gathers of W small items) and
  REFT-load's inventories (an all-gather of W of them, each pickled);
* planning: the bench's CPU fit of REFT-load's pure plan;
* detection: the supervisor's 20 ms poll, plus its pass over the W workers.

Moving the lost node's state is REFT-load's (the planner's load_node_lost_s), added
apart. Anchors, for the reader: other systems' published figures at their sizes.
"""

from __future__ import annotations

import math

# measured 2026-11-29 by benchmarks/bench_control_plane.py (W = 16..1024, node loss,
# after the cuts): store ops per rank a*W^k per phase (rendezvous: the spares' only);
# planning CPU, measured directly at 16,384 ranks (79 ms); the store server's per-op
# cost, the larger of two runs (2.2 and 7.1 us); a round trip between nodes, assumed
OPS_PER_RANK = {"abort": (14.5, 0.07), "rendezvous": (58.4, -0.99),
                "process groups": (3.0, 0.0), "first iteration": (2.0, 0.0)}
PLAN_FIT = (5e-6, 1.0)      # seconds of REFT-load's plan at W ranks
INVENTORY_BYTES = 362       # one rank's pickled inventory (three slots)
STORE_RTT_S = 100e-6        # a store round trip between nodes (TCP, one client)
SERVER_OP_S = 7.1e-6        # the TCPStore server's work per op (measured: multi_get)
POLL_S = 0.02               # the supervisor's poll of its workers
PASS_PER_RANK_S = 1e-6      # its pass over one worker
NIC_BYTES_S = 3e9           # one rank's share of a node's NICs (inventories' bytes)

ANCHORS = [  # (system, what, ranks/GPUs, seconds) as published
    ("TrainMover", "node loss", 1024, 20.0),
    ("SageMaker HyperPod checkpointless", "recovery", 2304, 120.0),
    ("FlashRecovery", "recovery", 4800, 150.0),
    ("NVRx in-process", "restart barrier", 16384, 0.5),
]


def phase_model(W: int, per_rank_ops: dict = OPS_PER_RANK, plan_fit=PLAN_FIT,
                inventory_bytes: int = INVENTORY_BYTES, rtt: float = STORE_RTT_S,
                server_op: float = SERVER_OP_S, latency: float = 30e-6,
                rpn: int = 8) -> dict:
    """{"phases": name -> seconds, "total_s"} of a node loss with a warm spare at W."""
    ph = {"detection": POLL_S + W * PASS_PER_RANK_S}
    for p, (a, k) in per_rank_ops.items():
        n = a * W ** k
        ph[p] = n * (rtt + 2 * latency) + W * n * server_op
    ph["new generation"] = (rpn + 2) * (rtt + 2 * latency)  # assign the spares, publish
    ph["start-up agreement"] = 3 * (W - 1) * latency + 3 * W * 8 / NIC_BYTES_S
    ph["inventory"] = 2 * (W - 1) * latency + W * inventory_bytes / NIC_BYTES_S
    ph["planning"] = plan_fit[0] * W ** plan_fit[1]
    ph["first iteration"] = ph.get("first iteration", 0.0) + \
        2 * math.ceil(math.log2(max(W, 2))) * latency  # a barrier: tree
    return {"phases": ph, "total_s": sum(ph.values())}


def recovery_rows(plan, rel, rows: list[dict], latency: float) -> list[dict]:
    """Per --world-sizes row: control-plane and REFT-load seconds per node loss, the
    downtime per failure and the goodput it implies (failures of rel.cfg's rate per
    node, the snapshot interval's work lost on average half)."""
    from reft_ext.plan.reliability import goodput, mtbf_hours

    out = []
    for r in rows:
        W = r["world_size"]
        ph = phase_model(W, latency=latency, rpn=plan.par.ranks_per_node)
        cp = ph["total_s"] - ph["phases"]["inventory"]  # (in REFT-load's agreement)
        load = r["load_node_lost_s"] if r["load_node_lost_s"] is not None else r["load_crash_s"]
        down = cp + load
        rate = r["nodes"] / mtbf_hours(rel.cfg.weibull_lambda, rel.cfg.weibull_shape)
        interval = plan.snap.snapshot_every * r["iteration_s"] / 3600
        g = goodput(interval, r["overhead"] * interval, down / 3600, rate)
        out.append({"world_size": W, "control_plane_s": cp, "load_s": load,
                    "downtime_s": down, "failures_per_day": 24 * rate, "goodput": g})
    return out


def recovery_table(plan, rel, rows: list[dict], latency: float) -> str:
    lines = ["Recovery at scale (docs/scale.md): a node loss with a warm spare, control "
             "plane modelled from benchmarks/bench_control_plane.py, plus REFT-load:\n",
             "| ranks | control plane | REFT-load (lost node) | downtime / failure | "
             "failures / day | goodput |", "|---|---|---|---|---|---|"]
    for x in recovery_rows(plan, rel, rows, latency):
        lines.append(f"| {x['world_size']} | {x['control_plane_s']:.2f} s | "
                     f"{x['load_s']:.2f} s | {x['downtime_s']:.2f} s | "
                     f"{x['failures_per_day']:.2f} | {x['goodput']:.2%} |")
    lines.append("\nPublished anchors: " + "; ".join(
        f"{s} {w} at {n:,} GPUs: {t:g} s" for s, w, n, t in ANCHORS))
    return "\n".join(lines)
