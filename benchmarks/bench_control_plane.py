"""A recovery at 1,024 and 16,384 ranks: REFT's control plane measured on its own code
with simulated ranks (docs/scale.md "Recovery at scale").

Each (W, case) runs in a child process (benchmarks/control_plane_sim.py): the real
in-process supervisor and its TCPStore, W ranks as threads running the real
Generation/abort-watcher protocol with signed values, each generation's signed process
group store, and REFT-load's real inventory and plan over a synthetic TP8 x PP8 x DP
state. Cases: ``crash`` (one rank dies, a warm worker takes its place) and ``node``
(a node's ranks die, a warm spare node takes theirs). Per phase: the time measured
here (every simulated rank shares this host's cores: an upper bound of what W hosts
take), the store ops and bytes, and a fit a*W^k. The downtime at 1,024 and 16,384
ranks is then MODELLED: per store phase, a rank's own ops times the round trip plus
every rank's ops times the server's per-op cost (both measured here), the collectives
(start-up agreement, the inventories' all-gather, the first iteration's barrier) from
ring/tree steps of --collective-latency, planning from its measured CPU fit. Moving the
lost node's state (REFT-load's exchange) is reported apart (python -m reft_ext.plan).

    PYTHONPATH=$PWD python benchmarks/bench_control_plane.py --ranks 16,64,256,1024
    PYTHONPATH=$PWD python benchmarks/bench_control_plane.py --ranks 16,256 \
        --store-clients 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORE_PHASES = ("detection", "abort", "new generation", "rendezvous", "process groups",
                "first iteration")
COUNTED = {"abort": ("abort", "supervisor"), "rendezvous": ("rendezvous", "start"),
           "process groups": ("process groups",), "first iteration": ("first iteration",)}
APART = ("exchange",)  # REFT-load's connects to its sharding group (not the control plane)


def child(args) -> None:
    import threading

    sys.path[:0] = [REPO, HERE]
    threading.stack_size(512 * 1024)
    import control_plane_sim as sim

    sim.raise_fd_limit()
    t = time.time()
    out = sim.run_case(args.one, args.case, args.ranks_per_node, args.gloo,
                       timeout=args.timeout)
    out["wall_s"] = time.time() - t
    out["store"] = sim.store_costs()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # (W daemon threads blocked in store waits: no teardown of each)


def run_one(w: int, case: str, gloo: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]), TMPDIR="/tmp")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(w), "--case", case,
           "--gloo", gloo, "--ranks-per-node", str(args.ranks_per_node),
           "--timeout", str(args.timeout)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                       timeout=args.timeout + 60)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"W={w} {case}: no result (rc {p.returncode}): "
                           "\n".join(x for x in p.stderr.splitlines()
                                     if x.startswith(("Traceback", "  ", "Timeout", "torch",
                                                      "RuntimeError"))
                                     and not x.startswith("frame"))[-1500:])
    return json.loads(line[7:])


def fit(ws: list[int], ys: list[float]) -> tuple[float, float]:
    """(a, k) of y = a * W^k, least squares in log-log (points <= 0 left out)."""
    pts = [(math.log(w), math.log(y)) for w, y in zip(ws, ys) if y > 0]
    if len(pts) < 2:
        return (ys[-1] if ys else 0.0), 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    k = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return math.exp(my - k * mx), k


def ops(r: dict, phase: str) -> tuple[int, int]:
    """(store ops, bytes) of a phase, all clients together."""
    c = r["counts"]
    return (sum(c.get(k, [0, 0])[0] for k in COUNTED.get(phase, ())),
            sum(c.get(k, [0, 0])[1] for k in COUNTED.get(phase, ())))


def model(rows: list[dict], W: int, latency: float, rpn: int) -> dict:
    """Modelled control-plane seconds per phase at W ranks (node case rows)."""
    from reft_ext.plan.recovery_model import phase_model

    ws = [r["world"] for r in rows]
    per_rank_ops = {p: fit(ws, [ops(r, p)[0] / r["world"] for r in rows]) for p in COUNTED}
    store = rows[-1]["store"]
    plan_fit = fit(ws, [r["seconds"]["planning"] for r in rows])
    return phase_model(W, per_rank_ops, plan_fit, rows[-1]["inventory_bytes"],
                       store["rtt_s"], store["server_op_s"], latency, rpn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="16,64,256,1024", help="simulated world sizes")
    ap.add_argument("--cases", default="crash,node")
    ap.add_argument("--store-clients", type=int, default=0,
                    help="also a node loss with this many simulated store clients (ranks)")
    ap.add_argument("--full-mesh-max", type=int, default=64,
                    help="also run gloo's full-mesh connect (every peer's address) up to W")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--collective-latency", type=float, default=30e-6,
                    help="seconds per ring step between nodes (TCP), as the planner's")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default="", help="write every measurement here")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--case", default="node", help=argparse.SUPPRESS)
    ap.add_argument("--gloo", default="lazy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return child(args)
    sys.path[:0] = [REPO]
    ws = [int(w) for w in args.ranks.split(",")]
    if min(ws) < 2 * args.ranks_per_node:
        sys.exit(f"--ranks: each at least 2 nodes ({2 * args.ranks_per_node})")
    t0 = time.time()
    runs = []
    for w in ws + ([args.store_clients] if args.store_clients else []):
        for case in args.cases.split(","):
            if w == args.store_clients and case != "node":
                continue
            for gloo in ("lazy", "full") if w <= args.full_mesh_max and case == "node" \
                    else ("lazy",):
                try:
                    runs.append(run_one(w, case, gloo, args))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"W={w} {case} {gloo}: failed: {exc}"[:400], flush=True)
    if not runs:
        sys.exit("no run finished")
    print(report(runs, args, time.time() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


def report(runs: list[dict], args, wall: float) -> str:
    from control_plane_sim import PHASES  # noqa: F401 - the order of the phases

    sys.path[:0] = [HERE]
    lines = [f"Recovery control plane, simulated ranks on this host "
             f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}); {wall:.0f} s\n",
             "| W | case | gloo | " + " | ".join(STORE_PHASES) +
             " | planning CPU | store ops/rank | store kB/rank | store connects/rank | gloo "
             "peers/rank (of them REFT-load's exchange) | sends/rank | agreed |",
             "|---|---|---|" + "---|" * (len(STORE_PHASES) + 7)]
    for r in runs:
        s = r["seconds"]
        tot = sum(ops(r, p)[0] for p in COUNTED)
        nbytes = sum(ops(r, p)[1] for p in COUNTED)
        lines.append(f"| {r['world']} | {r['case']} | {r['gloo']} | " +
                     " | ".join(f"{1e3 * s[p]:.0f} ms" for p in STORE_PHASES) +
                     f" | {1e3 * s['planning']:.1f} ms | {tot / r['world']:.1f} | "
                     f"{nbytes / r['world'] / 1e3:.2f} | {r['connects'] / r['world']:.2f} | "
                     f"{r['peers_max']} ({r['counts'].get('exchange', [0])[0] / r['world']:.0f} "
                     f"exchange) | {r['sends_max']} | "
                     f"{'yes' if r['agreed'] else 'NO'} |")
    node = sorted((r for r in runs if r["case"] == "node" and r["gloo"] == "lazy"),
                  key=lambda r: r["world"])
    ws = [r["world"] for r in node]
    lines.append("\nFits over the node-loss runs (W = " + ",".join(map(str, ws)) +
                 "): measured time a*W^k, store ops per rank a*W^k")
    for p in STORE_PHASES + ("planning",):
        a, k = fit(ws, [r["seconds"][p] for r in node])
        o = fit(ws, [ops(r, p)[0] / r["world"] for r in node]) if p in COUNTED else None
        lines.append(f"  {p:18s} time {a:.3g}*W^{k:.2f}" +
                     (f"; ops/rank {o[0]:.3g}*W^{o[1]:.2f}" if o else ""))
    st = node[-1]["store"]
    lines.append(f"\nThis host's TCPStore: {1e6 * st['rtt_s']:.0f} us per round trip, "
                 f"{1e6 * st['server_op_s']:.1f} us per op served (multi_get)")
    lines.append("\nMODELLED control-plane downtime of a node loss with a warm spare "
                 "(REFT-load's state movement apart):")
    for W in (1024, 16384):
        m = model(node, W, args.collective_latency, args.ranks_per_node)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in m["phases"].items())
        lines.append(f"  W={W}: {m['total_s']:.2f} s ({parts})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
