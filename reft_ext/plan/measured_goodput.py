"""How goodput is shown: the end-of-run ``[REFT] goodput: ...`` line, the status tool's
table, and beside them the planner's prediction (reft_ext/plan/reliability.py, Daly's
model) for the failure rate, snapshot cost and restart time this job actually had.

The prediction covers what the model covers: iterations, snapshots, failures and their
rollbacks. Its measured counterpart is therefore the share of productive time in the
time those account for (start-up, persistent saves, validation and waiting for a slower
rank left out); the plain goodput is productive time over the whole wall time.
"""

from __future__ import annotations

from reft_ext.report.goodput import CATEGORIES, FAILURE, PRODUCTIVE

HOUR = 3600.0
MODELLED = (PRODUCTIVE, "snapshot", *FAILURE)  # what Daly's model accounts for


def _pct(x: float, whole: float) -> str:
    return f"{100.0 * x / whole:.2f}%" if whole > 0 else "-"


def measured(t: dict) -> dict:
    """goodput over the wall time, and over the modelled time (see the module doc)."""
    sec, wall = t["seconds"], t["wall"]
    modelled = sum(sec[c] for c in MODELLED)
    return dict(goodput=sec[PRODUCTIVE] / wall if wall > 0 else 0.0,
                modelled=sec[PRODUCTIVE] / modelled if modelled > 0 else 0.0)


def predicted(t: dict, snapshot_every: int = 1) -> dict | None:
    """The planner's goodput for this job's own figures: its failures per hour of the
    modelled time, REFT's blocking per snapshot interval, the mean downtime per failure;
    None before any iteration. Daly's model is exponential in rate x downtime: it matches
    a measured run where failures are rare against the recovery (a long job), not a
    minutes-long test with a failure injected into every attempt."""
    from reft_ext.plan.reliability import goodput

    sec, wall, its = t["seconds"], t["wall"], t["iterations"]
    if its <= 0 or wall <= 0 or sec[PRODUCTIVE] <= 0:
        return None
    every = max(1, snapshot_every)
    work = sec[PRODUCTIVE] / its * every            # seconds between two snapshots
    cost = sec["snapshot"] / its * every            # REFT's blocking per snapshot
    failures = t["failures"]
    # a straggler swap's downtime is booked in the failure categories too
    restarts = failures + t.get("swaps", 0)
    restart = sum(sec[c] for c in FAILURE if c != "lost") / restarts if restarts else 0.0
    # per second of the time the model covers (a failure cannot strike start-up or a
    # save in its terms): the job's own rate, its recoveries included
    rate = failures / max(1e-9, sum(sec[c] for c in MODELLED))
    return dict(goodput=goodput(work, cost, restart, rate), failures_per_hour=rate * HOUR,
                restart_s=restart, snapshot_ms=1000.0 * cost, interval_s=work)


def line(t: dict, snapshot_every: int = 1) -> str:
    """One line without the ``[REFT]`` prefix: the goodput, each category's seconds and
    share of the wall time, and the planner's prediction beside the measured figure."""
    sec, wall = t["seconds"], t["wall"]
    m = measured(t)
    parts = ", ".join(f"{c.replace('_', ' ')} {sec[c]:.2f} s ({_pct(sec[c], wall)})"
                      for c in CATEGORIES if sec[c] > 0.0005 or c == PRODUCTIVE)
    booked = sum(sec.values())
    text = (f"goodput: {100 * m['goodput']:.2f}% of {wall:.2f} s wall time "
            f"({t['ranks']} ranks, {t['attempts']} process attempt"
            f"{'s' if t['attempts'] != 1 else ''}, {t['failures']} failure"
            f"{'s' if t['failures'] != 1 else ''}, {t['rollbacks']} rollback"
            f"{'s' if t['rollbacks'] != 1 else ''}, " +
            (f"{t['swaps']} straggler swap{'s' if t['swaps'] != 1 else ''}, "
             if t.get("swaps") else "") + f"{t['iterations']} iterations kept): "
            f"{parts}; categories sum to {booked:.2f} s")
    p = predicted(t, snapshot_every)
    if p is not None and not t["failures"]:
        # with no failure Daly's model returns the measured productive share itself
        text += ("; planner comparison: no failure happened, nothing to compare (its "
                 "model is checked against runs with failures)")
    elif p is not None:
        text += (f"; planner predicts {100 * p['goodput']:.2f}% for {p['failures_per_hour']:.3g} "
                 f"failures/h, {p['restart_s']:.2f} s per recovery, {p['snapshot_ms']:.2f} ms "
                 f"snapshot blocking per {p['interval_s']:.3f} s of training; measured "
                 f"{100 * m['modelled']:.2f}% of the same")
    return text


def table(t: dict, snapshot_every: int = 1) -> str:
    """The status tool's rows: category, seconds, share of the wall time."""
    sec, wall = t["seconds"], t["wall"]
    rows = [("category", "seconds", "share")]
    rows += [(c.replace("_", " "), f"{sec[c]:.2f}", _pct(sec[c], wall)) for c in CATEGORIES]
    rows.append(("wall time", f"{wall:.2f}", f"(sum {sum(sec.values()):.2f} s)"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    m, p = measured(t), predicted(t, snapshot_every)
    out.append(f"goodput {100 * m['goodput']:.2f}% ({t['failures']} failures, "
               f"{t['rollbacks']} rollbacks, {t.get('swaps', 0)} straggler swaps, "
               f"{t['attempts']} process attempts, "
               f"{t['iterations']} iterations kept, mean of {t['ranks']} ranks)")
    if p is not None and not t["failures"]:
        out.append("planner: no failure happened, nothing to compare")
    elif p is not None:
        out.append(f"planner: {100 * p['goodput']:.2f}% predicted for "
                   f"{p['failures_per_hour']:.3g} failures/h, {p['restart_s']:.2f} s per "
                   f"recovery, {p['snapshot_ms']:.2f} ms snapshot blocking per "
                   f"{p['interval_s']:.3f} s; measured {100 * m['modelled']:.2f}% of the same")
    return "\n".join(out)


def read_own(path: str) -> list[dict]:
    """The events of ``path`` (a job's ``$REFT_EVENTS_FILE``), opened without following a
    link and read only if this user's own: figures another user could plant are not
    shown as the job's. OSError/ValueError with a line naming the file otherwise."""
    import json
    import os

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise ValueError(f"{path} belongs to uid {st.st_uid}, not to this user: not read")
        out = []
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue  # a line a killed process left half-written
        return out


def status_text(events: list[dict], now: float) -> str:
    """tools/reft_status.py's goodput section: one table per run in the events."""
    from reft_ext.report.goodput import job_totals, latest

    parts = []
    for run, ranks in latest(events).items():
        recs = list(ranks.values())
        done = all(r.get("final") for r in recs)
        age = now - max(r.get("time", now) for r in recs)
        every = max((int(r.get("snapshot_every", 1)) for r in recs), default=1)
        state = "finished" if done else f"running: newest record {age:.1f} s old"
        parts.append(f"goodput of run {run} ({state}; iteration "
                     f"{max(int(r.get('iteration') or 0) for r in recs)})\n" +
                     table(job_totals(recs), every) + _stragglers(events, recs))
    return "\n\n".join(parts)


def _stragglers(events: list[dict], recs: list[dict]) -> str:
    """The run's named stragglers and swaps (events between its first and last record's
    processes: the events file may hold other runs)."""
    t0 = min(float(r.get("start", 0)) for r in recs)
    lines = []
    for e in events:
        if e.get("time", 0) < t0:
            continue
        if e.get("event") == "straggler":
            lines.append(f"straggler: rank {e.get('rank')} named at iteration "
                         f"{e.get('iteration')} ({e.get('ratio', 0):.2f}x, "
                         f"{1000 * e.get('cost_s', 0):.1f} ms per iteration)")
        elif e.get("event") == "straggler_swap":
            lines.append(f"straggler swap: node {e.get('node')} after iteration "
                         f"{e.get('iteration')} (est. {e.get('saved_s', 0):.1f} s saved)")
    return "".join("\n" + ln for ln in lines)
