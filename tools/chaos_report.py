"""The chaos campaign's report (tools/chaos.py): one line per fault, one per job run,
the summary table (docs/chaos.md shows it as printed), the campaign's verdict and its
JSON results file."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys

from reft_ext.report.files import open_nofollow
from tools.chaos_plan import KINDS, SLOW_PHASE, WALL_CLOCK, Fault, RunPlan, available_phases

# ---- the report ------------------------------------------------------------------------
def fault_line(f: Fault) -> str:
    out = [f"#{f.id:<3d} run {f.run:<2d} {f.layout:<22s} att {f.attempt} "
           f"{f.describe()}"]
    if f.fired and f.origin == "watcher":
        out.append("-> the flush it cut short must never be imported")
    elif f.fired and f.origin == "straggler":  # no recovery: slow, never stopped
        out.append(f"-> named a straggler at iteration {f.tier.split()[-1]}"
                   if f.tier.startswith("named") else "-> not named")
    elif f.fired:
        rec = f.tier or "?"
        if f.restored is not None:
            rec = f"iteration {f.restored} from {f.tier}"
        if f.recovery_ms is not None:
            rec += f" in {f.recovery_ms:.0f} ms"
        out.append(f"-> {rec}")
        if f.hang_s is not None:
            out.append(f"hang found after {f.hang_s:.1f} s")
        if f.downtime_s is not None:
            out.append(f"downtime {f.downtime_s:.1f} s")
    out.append(f"[{f.verdict}]")
    if f.problems:
        out.append("; ".join(f.problems))
    return " | ".join(out)


def summary(runs: list[dict], faults: list[Fault], opts) -> dict:
    by_pk = collections.Counter((f.phase, f.kind) for f in faults)
    exact_pk = collections.Counter((f.phase, f.kind) for f in faults if f.verdict == "exact")
    tiers = collections.Counter(f.tier.split(" (after")[0] for f in faults
                                if f.fired and f.stops)
    fired = [f for f in faults if f.fired]
    return {
        "faults": len(faults), "fired": len(fired),
        "exact": sum(1 for f in faults if f.verdict == "exact"),
        "bit_exact_pct": round(100.0 * sum(1 for f in faults if f.verdict == "exact") /
                               max(len(fired), 1), 1),
        "runs": len(runs), "runs_exact": sum(1 for r in runs if r["exact"]),
        "by_phase_kind": {f"{p}/{k}": [by_pk[(p, k)], exact_pk[(p, k)]]
                          for p, k in sorted(by_pk)},
        "by_tier": dict(tiers.most_common()),
        "stragglers": sum(1 for f in faults if f.origin == "straggler" and f.fired),
        "stragglers_named": sum(1 for f in faults if f.origin == "straggler" and
                                f.tier.startswith("named")),
        "hangs": sum(1 for f in faults if f.kind in ("stop", "ext-stop") and f.fired),
        "hangs_past_timeout": sum(1 for f in faults if f.hang_verdict in ("missed",
                                                                          "found late")),
        "torn_loads": sum(len(r["torn"]) for r in runs),
        "false_hang_verdicts": sum(len(r["false_hangs"]) for r in runs),
        "false_health_verdicts": sum(len(r["false_health"]) for r in runs),
        "not_fired": sum(1 for f in faults if not f.fired),
        "leaked_processes": sum(len(r.get("leaked", ())) for r in runs),
        "downtime_s_median": _median([f.downtime_s for f in faults if f.downtime_s]),
        "hang_found_s_median": _median([f.hang_s for f in faults if f.hang_s]),
    }


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def table(s: dict, faults: list[Fault]) -> str:
    """The campaign's table (markdown: docs/chaos.md shows it as printed)."""
    kinds = [k for k in KINDS if any(f.kind == k for f in faults)]
    order = available_phases() + (WALL_CLOCK, SLOW_PHASE)
    phases = sorted({f.phase for f in faults},
                    key=lambda p: order.index(p) if p in order else 99)
    out = ["faults by phase and kind (exact/total):", "",
           "| phase | " + " | ".join(kinds) + " | all |",
           "|---|" + "---|" * (len(kinds) + 1)]
    for p in phases:
        cells = []
        for k in kinds:
            tot, ok = s["by_phase_kind"].get(f"{p}/{k}", [0, 0])
            cells.append(f"{ok}/{tot}" if tot else "")
        tot = sum(s["by_phase_kind"].get(f"{p}/{k}", [0, 0])[0] for k in kinds)
        ok = sum(s["by_phase_kind"].get(f"{p}/{k}", [0, 0])[1] for k in kinds)
        out.append(f"| {p} | " + " | ".join(cells) + f" | {ok}/{tot} |")
    out += ["", "recoveries by tier:", "", "| tier | faults |", "|---|---|"]
    out += [f"| {t} | {n} |" for t, n in s["by_tier"].items()]
    out += ["", "| check | result |", "|---|---|",
            f"| faults (fired) | {s['faults']} ({s['fired']}) |",
            f"| bit-exact (of the faults that fired) | {s['exact']}/{s['fired']} = "
            f"{s['bit_exact_pct']}% |",
            f"| job runs exact | {s['runs_exact']}/{s['runs']} |",
            f"| hangs (SIGSTOP) found by the watcher | {s['hangs'] - s['hangs_past_timeout']}"
            f"/{s['hangs']} (median {s['hang_found_s_median']} s) |",
            f"| hangs past the hang timeout | {s['hangs_past_timeout']} |",
            f"| stragglers (slow) named by the detector | {s['stragglers_named']}"
            f"/{s['stragglers']} (a restart restarts its window) |",
            f"| torn / wrong loads | {s['torn_loads']} |",
            f"| false hang verdicts | {s['false_hang_verdicts']} |",
            f"| false health verdicts | {s['false_health_verdicts']} |",
            f"| faults that never fired | {s['not_fired']} |",
            f"| processes a killed rank left behind (killed by the tool) | "
            f"{s['leaked_processes']} |",
            f"| median downtime per fault | {s['downtime_s_median']} s |"]
    return "\n".join(out)


def report_run(p: RunPlan, rec: dict, write=print) -> None:
    for f in p.faults:
        write(fault_line(f))
    verdict = "exact" if rec["exact"] else "NOT EXACT: " + "; ".join(
        rec["problems"] or ["see the faults above"])
    extra = []
    if rec["false_hangs"]:
        extra.append(f"false hang verdicts {rec['false_hangs']}")
    if rec["false_health"]:
        extra.append(f"false health verdicts {rec['false_health']}")
    if rec["leaked"]:
        extra.append(f"left behind by killed ranks: {rec['leaked']}")
    write(f"run {p.index}: {verdict} ({rec['seconds']:.0f} s, {rec['restarts']} "
          f"restarts){'; ' + '; '.join(extra) if extra else ''}")


def finish(opts, runs: list, faults: list) -> tuple[dict, int]:
    """The summary table, the verdict, the JSON file; (results, exit code)."""
    s = summary(runs, faults, opts)
    print("\n== chaos campaign ==")
    print(table(s, faults))
    failed = [f"{n} {what}" for n, what in (
        (s["fired"] - s["exact"], "faults not recovered bit-exact"),
        (s["runs"] - s["runs_exact"], "job runs not exact"),
        (s["hangs_past_timeout"], "hangs past the hang timeout"),
        (s["torn_loads"], "torn / wrong loads"),
        (s["false_hang_verdicts"], "false hang verdicts"),
        (s["false_health_verdicts"], "false health verdicts")) if n]
    bad = bool(failed)
    print(f"verdict: {s['exact']}/{s['fired']} faults that fired recovered bit-exact "
          f"({s['not_fired']} never fired); "
          f"{'no other finding' if not bad else 'FAILED: ' + ', '.join(failed)}")
    results = {"command": " ".join(sys.argv), "seed": opts.seed,
               "options": {k: v for k, v in vars(opts).items() if k != "func"},
               "summary": s, "table": table(s, faults), "runs": runs,
               "faults": [dict(dataclasses.asdict(f), origin=f.origin, specs=f.specs())
                          for f in faults]}
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open_nofollow(opts.out) as fh:  # never through a planted link
            json.dump(results, fh, indent=1)
        print(f"results: {opts.out}")
    return results, 1 if bad else 0
