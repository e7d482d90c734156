"""Chaos campaign: random faults at random moments, each recovery checked bit for bit.

    python tools/chaos.py --seed 1 --faults 30 --layouts pp2dp2:arc dp4:aec \\
        --out runs/chaos/results.json

For each layout (``LAYOUT:PROTECT``, LAYOUT a name of tests/harness/run.py's LAYOUTS) the
job runs once failure-free (the reference: the same model, data and layout without REFT
and without faults), then in several job runs of ``--faults-per-run`` faults each. Every
fault of a job run lands on its own torchrun attempt (attempt 0 meets the first, the
restarted attempt 1 the second, ...; ``--max-restarts`` is the number of faults), so each
restart meets the next fault:

* inside the processes (``--inject-fault RANK:ITER:SIGNAL:MODE:ATTEMPT@PHASE``,
  reft_ext/testing/fault_specs.py): a random rank, phase (the moments of an
  iteration, of a persistent save, of the start-up health check, of REFT-load, ...),
  iteration and kind: SIGKILL, SIGTERM, SIGSTOP (a hang that REFT's watcher must end
  within ``--hang-timeout``), a lost node (the rank and its failure domain's shared
  memory), a corrupted snapshot (flipped byte in the own slice or in the replica, a
  rewritten manifest or commit pointer; then SIGKILL), a full /dev/shm; and, beside a
  kill, a node watcher killed halfway through its flush (``REFT_WATCHER_FAULT``);
* from outside, at a random wall-clock moment (a random fraction of an iteration after
  a random iteration's log line): SIGKILL or SIGSTOP of a random worker found in
  torchrun's process tree, or a lost node (its watcher and worker SIGKILLed, its
  /dev/shm directory removed);
* beside them (``--slow-share``), a straggler: a random rank twice as slow from a random
  iteration on, on every attempt (``RANK:ITER:CONT:slow:2``); it stops nothing, it must
  change no bit, and the line says whether straggler detection named it.

Each job run is then compared with the reference: every rank's final state hash
([HASH]), every later loss ([LOSSES], bit for bit) and every iteration's logged loss of
every attempt (a wrong state loaded by a recovery shows at the next iteration). The
events file (``REFT_EVENTS_FILE``, reft_ext/report/events.py) says which tier recovered
each fault (own memory, ARC replica, AEC parity, AOR replica, the flushed tier, the
persistent checkpoint, or a fresh start), how long REFT-load took and whether a hang
was found and by whom. One line per fault, a verdict, and a summary table at the end:
faults by phase and kind, recoveries by tier, bit-exact %, hangs past the hang timeout,
torn (wrong) loads, false hang / health verdicts. Exit code 1 on any outcome that is not
exact (a run that failed or differs, a hang past the timeout, a fault that never fired,
a false verdict). ``--out`` writes everything as JSON. docs/chaos.md explains the checks.

This file is the command line and the campaign loop; its parts are tools/chaos_plan.py
(what a fault can be, the seeded plan), chaos_run.py (one job run and the faults sent
from outside), chaos_verdicts.py (the comparison with the reference, each fault's
outcome) and chaos_report.py (the lines, the table, the JSON results).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # python tools/chaos.py: the repository's packages
    sys.path.insert(0, REPO)

from reft_ext import safe_dir  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402
from tests.harness.run import parse  # noqa: E402
from tools.chaos_plan import (  # noqa: E402,F401 (the phase sets: tests read them here)
    ARMED_PHASES, EXTERNAL_KINDS, INTERNAL_KINDS, KINDS, RESTART_PHASES, SAVE_PHASES,
    STRAGGLER_KINDS, TERMINAL_PHASES, WATCHER_KINDS, Fault, RunPlan, available_phases,
    layout_of, plan_campaign)
from tools.chaos_report import finish, report_run  # noqa: E402
from tools.chaos_run import JobOutput, base_args, cleanup_shm, fault_args, run_job  # noqa: E402
from tools.chaos_verdicts import analyze, iteration_losses  # noqa: E402

# the campaign of `make chaos` (docs/chaos.md)
DEFAULT_LAYOUTS = ["tp2dp2:arc", "pp2dp2-zero1:arc,aor", "dp4:aec", "dp4-zero1:aec,aor",
                   "pp2-interleaved:arc"]

# ---- the campaign ----------------------------------------------------------------------
def reference(layout: str, iters: int, opts, work: str, cache: dict):
    key = (layout, iters)
    if key not in cache:
        log = os.path.join(work, f"reference-{layout}-{iters}.log")
        ckpt = os.path.join(work, f"reference-{layout}-{iters}-ckpt")
        shutil.rmtree(ckpt, ignore_errors=True)
        job = run_job(base_args(layout, iters) + ["--save", ckpt], max_restarts=0,
                      timeout=opts.run_timeout, log_path=log)
        job.result.checkpoint = ckpt  # the verdicts compare every run's final one with it
        if job.returncode != 0 or not job.result.hashes:
            raise SystemExit(f"chaos: the reference run of {layout} failed "
                             f"(exit {job.returncode}); see {log}")
        cache[key] = (job.result, {it: v for _, it, v in iteration_losses(job.lines)})
    return cache[key]


def run_campaign(opts, references: dict | None = None) -> tuple[dict, int]:
    """Plan, run, analyze, report. ``references``: (layout, iters) -> (RunResult, {iteration:
    logged loss}) computed elsewhere (a test's shared reference runs). Returns the
    JSON-able results and the exit code."""
    work = opts.work_dir = opts.work_dir or tempfile.mkdtemp(prefix="chaos-")
    # its checkpoints are loaded (--load) and its logs written: a directory of this user's
    safe_dir.open_dir(work, create=True).close()
    plans = plan_campaign(opts)
    faults = [f for p in plans for f in p.faults]
    refs = dict(references or {})
    print(f"chaos: {len(faults)} faults in {len(plans)} job runs, seed {opts.seed}, "
          f"layouts {' '.join(opts.layouts)}; logs in {work}", flush=True)
    runs, done_before = [], 0
    bar = Progress(len(faults), desc="chaos", unit="fault", every_s=opts.progress_every)
    for p in plans:
        ref, ref_losses = reference(p.layout, p.train_iters, opts, work, refs)
        job = f"chaos{os.getpid()}-{opts.seed}-{p.index}"
        ckpt = os.path.join(work, f"run{p.index}-ckpt")
        shutil.rmtree(ckpt, ignore_errors=True)
        log = os.path.join(work, f"run{p.index}.log")
        ext = [f for f in p.faults if f.origin == "external"]
        bar.write(f"run {p.index}: {p.name}, {p.train_iters} iterations, "
                  f"--inject-fault {p.inject() or '-'}"
                  f"{', REFT_WATCHER_FAULT=' + p.watcher_env() if p.watcher_env() else ''}"
                  f"{', external: ' + ', '.join(f.describe() for f in ext) if ext else ''}")
        try:
            out = run_job(fault_args(p, opts, ckpt, job), max_restarts=p.restarts(),
                          timeout=opts.run_timeout, log_path=log, externals=ext,
                          watcher_fault=p.watcher_env(), job=job,
                          on_fault=lambda: bar.update(1))
        finally:
            cleanup_shm(job)
        out.result.checkpoint = ckpt
        try:
            rec = analyze(p, out, ref, ref_losses, opts)
        finally:
            if not opts.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        rec["log"] = log
        runs.append(rec)
        report_run(p, rec, bar.write)
        bar.update(max(0, done_before + len(p.faults) - bar.n))
        done_before += len(p.faults)
    bar.close()
    return finish(opts, runs, faults)


def _read_log(path: str) -> list:
    """A job run's log as run_job wrote it: (time, line) per line."""
    out = []
    with open(path, errors="replace") as f:
        for raw in f:
            t, _, line = raw.rstrip("\n").partition(" ")
            try:
                out.append((float(t), line))
            except ValueError:
                if out:
                    out.append((out[-1][0], raw.rstrip("\n")))
    return out


def reanalyze(path: str, out: str = "") -> tuple[dict, int]:
    """Analyze a finished campaign again from its logs and events files (``--reanalyze
    RESULTS.json``): the plan as the file recorded it, each run's log and events, the
    references' logs; faults sent from outside keep the moment recorded."""
    with open(path) as f:
        old = json.load(f)
    opts = options([])
    for k, v in old["options"].items():
        setattr(opts, k, v)
    opts.out = out
    plan_fields = {f.name for f in dataclasses.fields(Fault)
                   if f.name in ("id", "run", "layout", "attempt", "kind", "phase", "rank",
                                 "iteration", "candidates", "delay")}
    faults, plans, refs, runs = [], [], {}, []
    for r in old["runs"]:
        fs = []
        for d in (d for d in old["faults"] if d["run"] == r["run"]):
            f = Fault(**{k: d[k] for k in plan_fields})
            if f.origin == "external":
                for k in ("fired", "t_fired", "where", "pid"):
                    setattr(f, k, d[k])
            fs.append(f)
        name, protect, save = layout_of(r["layout"])
        p = RunPlan(r["run"], name, protect, r["train_iters"], fs, r["async_save"], save)
        plans.append(p)
        faults += fs
        key = (p.layout, p.train_iters)
        if key not in refs:
            work = opts.work_dir or os.path.dirname(r["log"])  # (the runs' own)
            lines = _read_log(os.path.join(work, f"reference-{p.layout}-{p.train_iters}.log"))
            res = parse("\n".join(line for _, line in lines), 0)
            refs[key] = (res, {it: v for _, it, v in iteration_losses(lines)})
        lines = _read_log(r["log"])
        res = parse("\n".join(line for _, line in lines), r["returncode"],
                    r["log"] + ".events.jsonl")
        job = JobOutput(r["returncode"], lines, list(res.events), res, r["seconds"],
                        r["timed_out"], r["restarts"], r.get("leaked", []))
        rec = analyze(p, job, *refs[key], opts)
        rec["log"] = r["log"]
        runs.append(rec)
        report_run(p, rec)
    return finish(opts, runs, faults)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="docs/chaos.md: what is checked, the table.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=20, help="faults in all (default 20)")
    p.add_argument("--faults-per-run", type=int, default=4,
                   help="faults per job run, one per torchrun attempt (default 4)")
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS,
                   metavar="LAYOUT:PROTECT[:nosave]",
                   help=f"job runs go round these (default {' '.join(DEFAULT_LAYOUTS)}); "
                        f"nosave: no persistent checkpoints in that layout's runs")
    p.add_argument("--kinds", nargs="+",
                   default=list(INTERNAL_KINDS + EXTERNAL_KINDS + STRAGGLER_KINDS),
                   choices=KINDS, metavar="KIND",
                   help=f"fault kinds drawn from (default all; watcher-kill goes beside "
                        f"a kill while the phase flush is drawn, --flush-share; slow, a "
                        f"straggler, beside a run's faults, --slow-share): "
                        f"{', '.join(KINDS)}")
    p.add_argument("--phases", nargs="+", default=None, metavar="PHASE",
                   help="phases drawn from for faults inside the processes (default every "
                        "phase of reft_ext/testing/fault_specs.py: "
                        f"{', '.join(available_phases())})")
    p.add_argument("--external-share", type=float, default=0.25,
                   help="share of faults sent from outside (default 0.25)")
    p.add_argument("--flush-share", type=float, default=0.2,
                   help="chance that a kill also kills a watcher mid-flush (phase flush)")
    p.add_argument("--slow-share", type=float, default=0.25,
                   help="chance that a job run also has a straggler (kind slow: a rank 2x "
                        "slower from a random iteration on; default 0.25)")
    p.add_argument("--iters", type=int, default=0,
                   help="iterations of every job run (default 4 + 3 x --faults-per-run)")
    p.add_argument("--save-interval", type=int, default=4,
                   help="persistent checkpoints every N iterations (default 4)")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="--reft-hang-timeout of the job runs (SIGSTOP faults)")
    p.add_argument("--collective-timeout-min", type=int, default=3,
                   help="--distributed-timeout-minutes: ends a hang the monitor missed")
    p.add_argument("--run-timeout", type=float, default=600.0,
                   help="seconds a job run may take before it counts as hung")
    p.add_argument("--work-dir", default="",
                   help="logs and checkpoints of the runs, a directory only this user can "
                        "write (default: a new private one in the temporary directory)")
    p.add_argument("--out", default="", help="JSON results file")
    p.add_argument("--keep", action="store_true", help="keep the runs' checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--reanalyze", metavar="RESULTS.json", default="",
                   help="analyze a finished campaign again from its logs (no job runs)")
    p.add_argument("--progress-every", type=float, default=None,
                   help="seconds between progress lines off a terminal (default 10)")
    return p


def options(argv=None):
    o = parser().parse_args(argv)
    known = available_phases()
    o.phases = list(o.phases or known)
    bad = [p for p in o.phases if p not in known]
    if bad:
        raise SystemExit(f"chaos: unknown phase(s) {bad}; "
                         f"reft_ext/testing/fault_specs.py has {', '.join(known)}")
    if "watcher-kill" in o.kinds and "flush" not in o.phases:
        o.phases.append("flush")
    o.kinds = [k for k in o.kinds if k not in WATCHER_KINDS]
    if not any(k in INTERNAL_KINDS + EXTERNAL_KINDS for k in o.kinds):
        # watcher-kill and slow go beside a fault that stops a process, never alone
        raise SystemExit(f"chaos: --kinds needs a kind that stops a process "
                         f"({', '.join(INTERNAL_KINDS + EXTERNAL_KINDS)})")
    o.async_save_ok = "save-async" in o.phases
    o.run_iters = o.iters or 4 + 3 * o.faults_per_run
    return o


def main(argv=None) -> int:
    opts = options(argv)
    if opts.reanalyze:
        return reanalyze(opts.reanalyze, opts.out)[1]
    if opts.dry_run:
        for p in plan_campaign(opts):
            print(f"run {p.index}: {p.name}, {p.train_iters} iterations, --inject-fault "
                  f"{p.inject() or '-'} {p.watcher_env()}")
            for f in p.faults:
                print(f"  #{f.id} attempt {f.attempt}: {f.describe()}")
        return 0
    return run_campaign(opts)[1]


if __name__ == "__main__":
    sys.exit(main())
