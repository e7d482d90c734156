"""Render a ``--reft-trace-file`` Chrome trace as a PNG timeline: one row per rank for
the schedule (forward, backward, p2p waits, optimizer step) and one below it for the
snapshot thread (chunks colored by tier: in a bubble, beside compute, at the step).

    python tools/plot_trace.py runs/trace.json -o docs/img/has_timeline.png \\
        [--iterations 5:6] [--title ...]

The same file opens interactively in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
import sys

COLORS = {
    "forward-compute": "#4c78a8", "backward-compute": "#72b7b2",
    "p2p-wait": "#e0e0e0", "optimizer": "#b279a2", "snapshot": "#9d755d",
    "snapshot-bubble": "#54a24b", "snapshot-compute": "#f58518", "snapshot-drain": "#e45756",
}
LABELS = {
    "forward-compute": "forward (micro-batch)", "backward-compute": "backward (micro-batch)",
    "p2p-wait": "p2p wait (bubble)", "optimizer": "optimizer step",
    "snapshot": "snapshot drain/commit (training thread)",
    "snapshot-bubble": "snapshot chunk in a bubble (tier 1)",
    "snapshot-compute": "snapshot chunk beside compute (tier 2)",
    "snapshot-drain": "snapshot chunk at the step (wait)",
}


def _key(e: dict) -> str:
    if e["cat"] == "compute":
        return e["name"]
    return e["cat"]


def load(path: str, iterations: tuple[int, int] | None) -> list[dict]:
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        sys.exit(f"error: {path}: not a readable Chrome trace ({e})")
    events = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    if iterations:
        lo, hi = iterations
        events = [e for e in events if lo <= e.get("args", {}).get("iteration", -1) <= hi]
    if not events:
        sys.exit(f"error: {path}: no events" + (f" in iterations {iterations}" if iterations
                                                 else ""))
    return events


def plot(events: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    rows = {}  # (rank, tid) -> y
    for r in ranks:
        rows[(r, "train")] = len(rows)
        rows[(r, "snapshot")] = len(rows)
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(rows) + 1.6))
    used = set()
    for e in events:
        y = rows.get((e["pid"], e["tid"]))
        if y is None:
            continue
        k = _key(e)
        c = COLORS.get(k, "#bbbbbb")
        used.add(k)
        ax.broken_barh([((e["ts"] - t0) / 1000, max(e["dur"], 1) / 1000)],
                       (y - 0.4, 0.8), facecolors=c, edgecolors="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} " + ("train" if t == "train" else "snapshot thread")
                        for r, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(events)} events, {len(ranks)} ranks)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("-o", "--output", default="trace.png")
    ap.add_argument("--iterations", default="", help="A:B, inclusive (default: all)")
    ap.add_argument("--title", default="REFT timeline")
    a = ap.parse_args(argv)
    its = None
    if a.iterations:
        try:
            lo, hi = (int(x) for x in a.iterations.split(":"))
        except ValueError:
            sys.exit(f"error: --iterations: expected A:B, got {a.iterations!r}")
        its = (lo, hi)
    plot(load(a.trace, its), a.output, a.title)


if __name__ == "__main__":
    main()
