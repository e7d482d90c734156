"""Print a REFT job's state table from the nodes' status files (reft_ext/cluster/status.py:
``<shm>/reft-<job>/node<n>.meta/status.json``, read only when this user's own).

    python tools/reft_status.py                  # every job found in /dev/shm
    python tools/reft_status.py --job JOB [--shm-dir DIR] [--json]
    python tools/reft_status.py --list-shm       # this user's host memory there, and its use
    python tools/reft_status.py --clean [--job JOB]   # remove what no process uses

One row per node: its ranks, its state (HEALTHY, SNAP, COMPLETED, UNHEALTHY, OFFLINE,
FINISHED), the last iteration whose snapshot it completed, how long ago it was updated,
whether its watcher runs, and the detail of the last transition. With the job's events
file (``--events``, default ``$REFT_EVENTS_FILE``): its goodput, each category of every
rank's wall time added up across the job's attempts, and the planner's prediction for the
job's own failure rate and costs (docs/operations.md "Goodput").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reft_ext.cluster import status  # noqa: E402


def _ranks(r: list[int]) -> str:
    if not r:
        return "-"
    return f"{r[0]}-{r[-1]}" if len(r) > 2 and r == list(range(r[0], r[-1] + 1)) else \
        ",".join(map(str, r))


def table(shm_dir: str, job: str, now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [("node", "ranks", "state", "iteration", "updated", "watcher", "detail")]
    for rec in status.read_job(shm_dir, job):
        it = rec.get("iteration")
        w = status.watcher_pid(shm_dir, job, rec["node"])
        rows.append((str(rec["node"]), _ranks(rec.get("ranks", [])), rec["state"],
                     "-" if it is None else str(it), f"{now - rec['updated']:.1f}s ago",
                     f"pid {w}" if w else "-", rec.get("detail", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"job {job} ({shm_dir})"]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="REFT job state table")
    p.add_argument("--job", default="", help="job id (--reft-job-id, else TORCHELASTIC_RUN_ID); "
                   "default: all")
    p.add_argument("--shm-dir", "--reft-shm-dir", default="/dev/shm", help="= --reft-shm-dir")
    p.add_argument("--list-shm", action="store_true",
                   help="this user's REFT job directories in --shm-dir: size, nodes, newest "
                        "iteration, the processes using them")
    p.add_argument("--clean", action="store_true",
                   help="remove this user's REFT host memory of --job (default: of every "
                        "job) that no process uses (a re-run then starts from the flushed "
                        "tier or --load)")
    p.add_argument("--json", action="store_true", help="the raw records as JSON")
    p.add_argument("--events", default=os.environ.get("REFT_EVENTS_FILE", ""),
                   help="the job's events file (REFT_EVENTS_FILE): its goodput too")
    a = p.parse_args(argv)
    if a.events:
        return _goodput(a)
    if not os.path.isdir(a.shm_dir):
        p.error(f"--shm-dir: {a.shm_dir!r} is not a directory")
    if a.job:  # as the job named its files (an id with other characters keeps a hash)
        from reft_ext.config import _job_id_of
        a.job = _job_id_of(a.job)
    if a.list_shm or a.clean:
        return _shm(a)
    jobs = [a.job] if a.job else status.jobs(a.shm_dir)
    if a.job and not status.read_job(a.shm_dir, a.job):
        print(f"--job: no status files of job {a.job!r} in {a.shm_dir}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({j: status.read_job(a.shm_dir, j) for j in jobs}, indent=1))
    else:
        print("\n\n".join(table(a.shm_dir, j) for j in jobs) or f"no REFT jobs in {a.shm_dir}")
    return 0


def _shm(a) -> int:
    """--list-shm, --clean (reft_ext/cluster/leftovers.py)."""
    from reft_ext.cluster import leftovers

    found = [j for j in leftovers.jobs(a.shm_dir) if not a.job or j["job"] == a.job]
    if a.clean:
        for j in found:
            print(leftovers.remove(a.shm_dir, j["job"]))
        if not found:
            print(f"no REFT host memory of this user's{' job ' + a.job if a.job else ''} "
                  f"in {a.shm_dir}")
        return 0
    if a.json:
        print(json.dumps(found, indent=1))
        return 0
    for j in found:
        use = f"in use by pid(s) {j['pids']}" if j["pids"] else \
            "no process uses it (a re-run of its job resumes from it; --clean removes it)"
        it = "-" if j["iteration"] is None else j["iteration"]
        print(f"{j['path']}: {j['bytes'] / 2**20:.1f} MiB, nodes {j['nodes']}, newest "
              f"iteration {it}; {use}")
    if not found:
        print(f"no REFT host memory of this user's in {a.shm_dir}")
    return 0


def _goodput(a) -> int:
    """The node table if the job's status files are here, and the goodput of the events."""
    from reft_ext.plan import measured_goodput as goodput_view
    from reft_ext.report import goodput

    try:
        evs = goodput_view.read_own(a.events)
    except (OSError, ValueError) as exc:
        print(f"--events: cannot read {a.events!r}: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({run: goodput.job_totals(list(ranks.values()))
                          for run, ranks in goodput.latest(evs).items()}, indent=1))
        return 0
    jobs = [a.job] if a.job else status.jobs(a.shm_dir)
    nodes = [table(a.shm_dir, j) for j in jobs if status.read_job(a.shm_dir, j)]
    text = goodput_view.status_text(evs, time.time())
    print("\n\n".join([*nodes, text or f"no goodput records in {a.events}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
