"""``python -m reft_ext.plan``: flags with Megatron's names, generated from the config
dataclasses; :func:`plan` does the same from Python and returns a :class:`PlanReport`,
which renders readable tables, a JSON document and the plots."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from reft_ext.plan.common import PlanConfigError, add_arguments, from_args
from reft_ext.plan.hardware import CostConfig, HardwareConfig, estimate, measure_cpu
from reft_ext.plan.model import ModelConfig, ParallelConfig
from reft_ext.plan.planner import Plan, SnapshotConfig
from reft_ext.plan.reliability import JobReliability, ReliabilityConfig
from reft_ext.plan.recovery_model import recovery_rows, recovery_table
from reft_ext.plan.scale import ScaleConfig, at_scale, paper_checks, paper_table, scale_table
from reft_ext.plan.state import group_placement

SECTIONS = ((ModelConfig, "model"), (ParallelConfig, "parallelism"),
            (HardwareConfig, "hardware"), (SnapshotConfig, "REFT"),
            (ReliabilityConfig, "reliability model"), (CostConfig, "training cost"),
            (ScaleConfig, "REFT at scale (docs/scale.md)"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m reft_ext.plan", allow_abbrev=False,
        description="Plan REFT snapshots, reliability and cost of a layout at cluster scale.")
    for cls, title in SECTIONS:
        add_arguments(p, cls, title)
    g = p.add_argument_group("precision")
    for flag in ("bf16", "fp16", "fp32"):
        g.add_argument(f"--{flag}", dest="precision", action="store_const", const=flag,
                       help=f"{flag} parameters" + (" (default)" if flag == "bf16" else ""))
    o = p.add_argument_group("output")
    o.add_argument("--measure", action="store_true",
                   help="measure this CPU now (--hardware cpu with measured figures)")
    o.add_argument("--json", action="store_true", help="print one JSON document")
    o.add_argument("--paper-check", action="store_true",
                   help="plan the paper's set-ups and compare with its reported figures")
    o.add_argument("--plot", metavar="PNG", help="draw survival curves and goodput")
    return p


@dataclass
class PlanReport:
    """The result of one planner call (``plan`` is None for a cost-only call)."""

    plan: Plan | None
    reliability: JobReliability | None
    cost: dict | None
    scale: tuple | None = None  # (ScaleConfig, rows): REFT at the --world-sizes

    def to_dict(self) -> dict:
        if self.plan is None:
            return {"cost": self.cost}
        out = to_dict(self.plan, self.reliability, self.cost)
        if self.scale:
            out["scale"] = self.scale[1]
            out["recovery_at_scale"] = recovery_rows(self.plan, self.reliability,
                                                     self.scale[1],
                                                     self.scale[0].collective_latency)
        return out

    def render(self) -> str:
        if self.plan is None:
            return cost_text(self.cost)
        parts = [describe(self.plan), placement_table(self.plan), stage_tables(self.plan),
                 host_table(self.plan), reliability_table(self.reliability)]
        if self.cost:
            parts.append(cost_text(self.cost))
        if self.scale:
            parts.append(scale_table(self.plan, *self.scale))
            parts.append(recovery_table(self.plan, self.reliability, self.scale[1],
                                        self.scale[0].collective_latency))
        return "\n\n".join(parts)


def _configs(args):
    if args.measure and args.hardware is not None and args.hardware.lower() != "cpu":
        raise PlanConfigError(f"--measure: measures this CPU; not with --hardware "
                              f"{args.hardware}")
    hw = measure_cpu() if args.measure else from_args(HardwareConfig, args)
    cost = from_args(CostConfig, args)
    model_given = args.model_size or args.num_layers
    if not model_given and cost.train_tokens and cost.num_parameters:
        return None, None, hw, None, None, cost, None
    # --bf16/--fp16/--fp32 share one dest outside the dataclass's flags: passed by hand,
    # else ModelConfig's default (bf16) silently replaced --fp32's 4-byte parameters
    model = from_args(ModelConfig, args,
                      **({"precision": args.precision} if args.precision else {}))
    return (model, from_args(ParallelConfig, args), hw, from_args(SnapshotConfig, args),
            from_args(ReliabilityConfig, args), cost, from_args(ScaleConfig, args))


def plan(argv: list[str] | None = None) -> PlanReport:
    """Plan from flags (as on the command line); raises PlanConfigError on bad input."""
    args = build_parser().parse_args(argv)
    model, par, hw, snap, rel_cfg, cost_cfg, scale_cfg = _configs(args)
    if model is None:  # cost only: --train-tokens and --num-parameters, no model
        return PlanReport(None, None, estimate(cost_cfg, cost_cfg.num_parameters,
                                               cost_cfg.num_gpus or 1, hw.device_flops,
                                               hw.mfu))
    p = Plan(model, par, hw, snap)
    rel = JobReliability(p, rel_cfg)
    cost = estimate(cost_cfg, model.num_parameters(), par.world_size, hw.device_flops,
                    hw.mfu, rel.goodput) if cost_cfg.train_tokens else None
    scale = (scale_cfg, [at_scale(p, scale_cfg, w) for w in scale_cfg.sizes]) \
        if scale_cfg.sizes else None
    report = PlanReport(p, rel, cost, scale)
    if args.plot:
        plot(rel, args.plot, title=report.render().split("\n")[1])
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--paper-check" in argv:
            return paper_check("--json" in argv)
        report = plan(argv)
    except PlanConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps(report.to_dict(), indent=1, default=_jsonable))
    else:
        print(report.render())
    return 0


def paper_check(as_json: bool) -> int:
    """Each of the paper's set-ups planned at its own size, beside the figure it reports."""
    results = []
    for c in paper_checks():
        r = plan(c["argv"])
        row = at_scale(r.plan, from_args(ScaleConfig, build_parser().parse_args(c["argv"])),
                       r.plan.par.world_size)
        results.append(dict(c, planner=row[c["key"]], detail=row))
    print(json.dumps(results, indent=1, default=_jsonable) if as_json else
          paper_table(results))
    return 0


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(type(x).__name__)


# ---- output ----------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if math.isinf(s):
        return "inf"
    if s >= 3600 * 48:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1000:.1f} ms"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (readable as text, pasteable into docs)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def describe(plan: Plan) -> str:
    m, p, hw = plan.model, plan.par, plan.hw
    name = m.model_size or f"{m.num_layers}x{m.hidden_size}"
    sched = f"interleaved 1F1B, {plan.vpp} chunks/stage" if plan.vpp > 1 else "1F1B"
    place = "OK" if plan.placement_error is None else "INVALID: " + plan.placement_error
    zero = "on" if p.use_distributed_optimizer else "off"
    fits = "fits" if plan.device_fits() else "DOES NOT FIT"
    dev = max(s.device_memory for s in plan.stages)
    model = (f"{name}: {m.num_parameters() / 1e9:.2f} B parameters, {m.precision}, "
             f"seq {m.seq_length}, vocab {m.padded_vocab_size(p.tp)} (padded)")
    layout = (f"{p.world_size} x {hw.hardware}: TP {p.tp} x PP {p.pp} x DP {p.dp} on "
              f"{p.nodes} node(s) of {p.ranks_per_node}; ZeRO-1 {zero}; "
              f"{p.num_microbatches} micro-batches of {p.micro_batch_size}; {sched}")
    if p.use_distributed_optimizer and not plan.snap.aor and plan.redundancy != "none":
        place += " (ZeRO-1 optimizer shards unprotected: see Reliability)"
    reft = (f"--reft-protect {plan.snap.protect}, snapshot every "
            f"{plan.snap.snapshot_every} iteration(s); placement {place}")
    summary = (f"iteration {fmt_time(plan.t_iter)} (model FLOPs at MFU {hw.mfu:.0%}); "
               f"snapshot overhead {plan.overhead_fraction:.2%}; REFT-load "
               f"{fmt_time(plan.load_crash)} after a crash, "
               f"{fmt_time(plan.load_node_lost)} after a lost node; device memory {fits} "
               f"({fmt_bytes(dev)} of {fmt_bytes(hw.device_memory)})")
    lines = [model, layout, reft, summary]
    return "\n".join(lines)


def placement_table(plan: Plan, rows: int = 64) -> str:
    """Who keeps whose redundancy in the first sharding group (stage 0, TP rank 0; every
    group is placed alike): reft_ext/protect/placement.py."""
    par = plan.par
    if plan.placement_error is not None:
        return f"Placement: none ({plan.placement_error})"
    p = group_placement(par, 0, plan.redundancy)
    head = (f"Placement of sharding group 0 (ranks {p.ranks[0]}..{p.ranks[-1]}, "
            f"{len(set(p.domains))} nodes, {p.D // len(set(p.domains))} member(s) per "
            f"node; every group alike):")
    body = []
    for d in p.ring[:rows]:
        keeps = p.protects(d)
        group = [p.ranks[m] for m in p.parity_group(d)]
        body.append([d, p.ranks[d], p.domains[d], f"rank {p.ranks[keeps]} (node "
                     f"{p.domains[keeps]})", " ".join(map(str, group))])
    more = f"\n({p.D - rows} more members on the ring)" if p.D > rows else ""
    return head + "\n\n" + table(["member", "rank", "node", "ARC/AOR: keeps the copy of",
                                   "AEC parity group (ranks)"], body) + more


def stage_tables(plan: Plan) -> str:
    bytes_rows = [[s.stage, f"{s.params / 1e6:.0f} M", fmt_bytes(s.model_bytes),
                   fmt_bytes(s.optimizer_bytes), fmt_bytes(s.replicated_bytes),
                   fmt_bytes(s.owned_bytes), fmt_bytes(s.slice_bytes),
                   fmt_bytes(s.redundancy_bytes), fmt_bytes(s.slot_bytes),
                   fmt_bytes(s.d2h_bytes), fmt_bytes(s.device_memory)] for s in plan.stages]
    time_rows = [[s.stage, fmt_time(s.t_fb), fmt_time(s.compute), fmt_time(s.bubble_1f1b),
                  fmt_time(s.bubble_interleaved), fmt_time(s.t_snapshot),
                  f"{fmt_bytes(s.bubble_bytes)} / {fmt_bytes(s.rest_bytes)}",
                  fmt_time(s.overhead), f"{s.overhead / plan.t_iter:.2%}",
                  fmt_time(s.host_busy), fmt_time(s.load_crash),
                  fmt_time(s.load_node_lost)] for s in plan.stages]
    return "\n\n".join([
        "Per stage, per rank (the largest member of the stage):",
        table(["stage", "params", "model", "optimizer", "replicated", "owned", "slice",
               "redundancy", "slot", "D2H/snapshot", "device mem"], bytes_rows),
        table(["stage", "t_fb", "compute", "bubble 1F1B", "bubble interleaved",
               "T_snapshot", "tier 1 / tier 2", "overhead", "overhead %", "host busy",
               "load crash", "load node lost"], time_rows)])


def host_table(plan: Plan) -> str:
    rows = [[s, fmt_bytes(v["bytes"]), fmt_bytes(v["state_bytes"]), f"{v['ratio']:.2f}x",
             "yes" if v["fits"] else "NO"] for s, v in plan.host_memory.items()]
    keep = plan.snap.keep_for(plan.par.nodes)
    return f"Host memory per node (largest node; {keep} slots per rank):\n\n" + table(
        ["scheme", "snapshots", "model+optimizer on node", "ratio", "fits"], rows)


def reliability_table(rel: JobReliability) -> str:
    d = rel.to_dict()
    until = {k: fmt_time(v * 3600) for k, v in d["hours_until_99"].items()}
    target = {k: fmt_time(v * 3600)
              for k, v in d["persistent_interval_hours_for_target"].items()}
    used = {k: fmt_time(v * 3600) for k, v in d["persistent_interval_hours"].items()}
    window = fmt_time(d["window_hours"] * 3600)
    rows = [
        ["node MTBF", fmt_time(d["mtbf_node_hours"] * 3600), ""],
        ["job failures per day", f"{d['failures_per_day']:.2f}", ""],
        ["state survives 99% (no repair)", until["none"],
         f"{until['single']} (1 failure/group), {until['double']} (2)"],
        ["unrecoverable failures", "100%",
         f"{d['unrecoverable_fraction']:.3%} (window {window})"],
        ["persistent interval for target", target["without"], target["with"]],
        ["persistent interval used", used["without"], used["with"]],
        ["goodput", f"{d['goodput']['without']:.1%}", f"{d['goodput']['with']:.1%}"]]
    head = (f"Reliability ({d['nodes']} nodes in groups of {d['group']}, Weibull "
            f"c={d['weibull_shape']:g}; persistent checkpoint "
            f"{fmt_time(d['persistent_save_seconds'])}; protected failures per group: "
            f"{d['protected_failures']}; lost-work target {rel.cfg.lost_work_target:.1%}):")
    out = head + "\n\n" + table(["", "without REFT", "with REFT"], rows)
    if d["unprotected_because"]:  # why "protected failures per group: 0"
        out += f"\n\nProtected failures per group: 0 because {d['unprotected_because']}."
    return out


def cost_text(cost: dict) -> str:
    text = (f"Cost: {cost['train_tokens']:.3g} tokens x 6 x {cost['parameters']:.3g} "
            f"parameters on {cost['gpus']} GPUs at {cost['device_flops'] / 1e12:.0f} "
            f"TFLOP/s x MFU {cost['mfu']:.0%}: {cost['compute_days']:.1f} days of compute "
            f"({cost['gpu_hours']:.3g} GPU-hours)")
    if "wall_days" in cost:
        w = cost["wall_days"]
        text += f"; wall clock {w['without']:.1f} days without REFT, {w['with']:.1f} with"
    return text


def to_dict(plan: Plan, rel: JobReliability | None, cost: dict | None) -> dict:
    ranks = []
    for r in range(plan.par.world_size):
        tp, dp, pp = plan.par.coords(r)
        s = plan.snapshot_of(pp, dp)
        ranks.append({"rank": r, "node": plan.reft.node_of(r), "stage": pp, "tp": tp,
                      "member": dp, "nbytes": s.slot_bytes,
                      "regions": {k: list(v) for k, v in s.regions.items()}})
    cfg = {k: asdict(v) for k, v in (("model", plan.model), ("parallel", plan.par),
                                     ("hardware", plan.hw), ("snapshot", plan.snap))}
    cfg["snapshot"].pop("reft", None)
    return {"config": cfg, "summary": {
        "world_size": plan.par.world_size, "nodes": plan.par.nodes,
        "parameters": plan.model.num_parameters(), "state_bytes": plan.state_bytes,
        "iteration_seconds": plan.t_iter, "overhead_fraction": plan.overhead_fraction,
        "load_crash_seconds": plan.load_crash, "load_node_lost_seconds": plan.load_node_lost,
        "placement_error": plan.placement_error, "device_memory_fits": plan.device_fits()},
        "stages": [asdict(s) for s in plan.stages], "host_memory": plan.host_memory,
        "reliability": rel.to_dict() if rel else None, "cost": cost, "ranks": ranks}


def plot(rel: JobReliability, path: str, title: str = "") -> None:
    """Survival of the in-memory state over time (the paper's Figure 8) and goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = rel.curves(400)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    hours = c["hours"]
    for key, label, style in (("none", "no protection (all nodes healthy)", "-"),
                              ("single", "ARC / AEC (1 failure per group)", "--"),
                              ("double", "composed (2 failures per group)", ":")):
        a.plot(hours / 24, c[key], style, lw=2, label=label)
    a.set_xlabel("days since the last persistent checkpoint (no repair)")
    a.set_ylabel("P(in-memory state survives)")
    a.set_ylim(-0.02, 1.02)
    a.grid(alpha=0.3)
    a.legend(loc="upper right", fontsize=8)
    a.set_title(f"{rel.nodes} nodes, sharding groups of {rel.group}, node MTBF "
                f"{rel.cfg.mtbf_hours / 24:.0f} d, c={rel.cfg.weibull_shape:g}", fontsize=9)
    g = rel.goodput
    bars = b.bar(["without REFT", "with REFT"], [g["without"], g["with"]],
                 color=["#b0b0b0", "#3a7ebf"])
    for bar, v in zip(bars, (g["without"], g["with"])):
        b.text(bar.get_x() + bar.get_width() / 2, v + 0.01, f"{v:.1%}", ha="center")
    b.axhline(0.44, color="#c04040", lw=1, ls="--")
    b.text(0.5, 0.41, "OPT-175B reported: 44%", color="#c04040", fontsize=8, ha="center",
           va="top", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    b.set_ylim(0, 1.08)
    b.set_ylabel("goodput (useful fraction of wall time)")
    b.set_title("expected goodput", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
