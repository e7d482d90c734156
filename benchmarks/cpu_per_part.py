"""CPU time of each part of REFT per iteration, in a real job: what each hook, thread and
helper costs the ranks (docs/has.md "CPU per part"). On a host where ranks outnumber
cores, CPU is what REFT takes from training; cProfile (profile_rank.py) doubles
Python-heavy code, this does not: each listed function is timed by the CPU clock of the
thread that runs it (``time.thread_time``), and every thread of the rank by /proc, both
between iteration ARM and the last, per iteration, averaged over the ranks.

    python benchmarks/cpu_per_part.py [--iters 60] [--none] [--parts mod:fn,...]
                                      [-- extra pretrain flags]

runs `make run`'s job (benchmarks/overhead_jobs.py; ``--none``: without any --reft-*
flag) through torchrun with this file as each rank's entry point, and prints the table.
A part listed inside another is counted in both (``after_step`` holds ``_begin``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import gc
import glob
import importlib
import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARM = 15  # the first iterations (start-up, first snapshots' slots) are not counted
PARTS = """
reft_ext.session:ReftSession.after_step reft_ext.session:ReftSession.before_optimizer_step
reft_ext.save.snapshotter:ReftSnapshotter._begin reft_ext.save.snapshotter:ReftSnapshotter._finish
megatron.training.reft_integration:MegatronStateAdapter.get_meta
reft_ext.store.slots:SnapshotStore.begin reft_ext.store.slots:SnapshotStore.finish
reft_ext.store.slots:SnapshotStore.commit reft_ext.cluster.status:NodeSignals.set
reft_ext.copy.pipeline:Pipelines.group reft_ext.save.early_seal:EarlySeal.__call__
reft_ext.save.has:run_units reft_ext.protect.aor.transport:AORTransport._on_step
reft_ext.protect.aor.replica:AORReplica.apply_message
reft_ext.report.timeline:PipelineEvents.phase_begin reft_ext.report.timeline:PipelineEvents.phase_end
reft_ext.report.timeline:PipelineEvents.wait_begin reft_ext.report.timeline:PipelineEvents.wait_end
megatron.training.goodput_integration:GoodputTracker.iteration_done
""".split()

_T = collections.defaultdict(lambda: [0, 0, 0])  # part -> [calls, cpu ns, wall ns]
_S: dict = {"armed": False}


def _timed(name, fn):
    def run(*a, **k):
        if not _S["armed"]:
            return fn(*a, **k)
        c, t = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            e = _T[name]
            e[0] += 1
            e[1] += time.thread_time_ns() - c
            e[2] += time.perf_counter_ns() - t
    run.__wrapped__ = fn
    return run


def _gc_timer():
    """A gc callback booking each collection's CPU as the part "gc genN": Python's
    collector runs where allocations cross its thresholds, so a hook that allocates
    makes training's own collections come sooner (Megatron's --manual-gc exists for it)."""
    start = {}

    def cb(phase, info):
        if not _S["armed"]:
            return
        if phase == "start":
            start["c"], start["t"] = time.thread_time_ns(), time.perf_counter_ns()
        elif "c" in start:
            e = _T[f"gc gen{info['generation']}"]
            e[0] += 1
            e[1] += time.thread_time_ns() - start.pop("c")
            e[2] += time.perf_counter_ns() - start.pop("t")
    return cb


def _threads() -> dict:
    """tid -> (name, CPU ticks, context switches) of this process's threads (Python's
    names where known)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        comm = text[text.index("(") + 1:text.rindex(")")]
        out[int(tid)] = (names.get(int(tid), comm), int(fields[11]) + int(fields[12]), switches)
    return out


def _owner(part: str):
    """(object holding the part, its last name, its qualname, the function) of
    ``module:qualname``; raises where it is not there."""
    mod, _, attr = part.partition(":")
    owner = importlib.import_module(mod)
    *path, last = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    return owner, last, attr, getattr(owner, last)


def _install(out_dir: str) -> None:
    more = os.environ.get("CPU_PER_PART_MORE", "").split(",")
    for part in PARTS + [p for p in more if p]:
        owner, last, attr, fn = _owner(part)
        setattr(owner, last, _timed(attr, fn))
    from megatron.training import goodput_integration as g

    done = g.GoodputTracker.iteration_done

    def iteration_done(self, s, *a, **k):
        r = done(self, s, *a, **k)
        if s.iteration == ARM and not _S["armed"]:
            _S.update(armed=True, it0=s.iteration, thr0=_threads())
        if _S["armed"]:
            _S.update(it=s.iteration, thr1=_threads())
        return r
    g.GoodputTracker.iteration_done = iteration_done
    gc.callbacks.append(_gc_timer())

    def dump():
        if not _S["armed"] or _S["it"] == _S["it0"]:
            return
        n, tick_ms = _S["it"] - _S["it0"], 1000.0 / os.sysconf("SC_CLK_TCK")
        threads, switches = collections.Counter(), collections.Counter()
        for tid, (name, ticks, sw) in _S["thr1"].items():
            _, ticks0, sw0 = _S["thr0"].get(tid, (name, 0, 0))
            threads[name] += (ticks - ticks0) * tick_ms / n
            switches[name] += (sw - sw0) / n
        res = {"parts": {k: [c / n, cpu / 1e6 / n, wall / 1e6 / n]
                         for k, (c, cpu, wall) in _T.items()}, "threads": threads,
               "switches": switches}
        with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(res, f)
    atexit.register(dump)


def _rank_main(out_dir: str) -> None:
    sys.path.insert(0, REPO)
    _install(out_dir)
    sys.argv = [os.path.join(REPO, "pretrain_llama.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _print(out_dir: str, label: str) -> None:
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out_dir, "rank*.json")))]
    if not ranks:
        sys.exit("no rank wrote its figures (did the job reach iteration "
                 f"{ARM + 1}? the job's output is above)")
    mean = (lambda xs: statistics.mean(xs) if xs else 0.0)
    print(f"\n{label}: per iteration, mean of {len(ranks)} ranks, iterations after {ARM}")
    print(f"| part | calls | CPU ms | wall ms |\n|---|---|---|---|")
    parts = {k for r in ranks for k in r["parts"]}
    for k in sorted(parts, key=lambda k: -mean([r["parts"].get(k, [0, 0, 0])[1] for r in ranks])):
        c, cpu, wall = (mean([r["parts"].get(k, [0, 0, 0])[i] for r in ranks]) for i in range(3))
        print(f"| {k} | {c:.1f} | {cpu:.3f} | {wall:.3f} |")
    print("| **thread** | **context switches** | **CPU ms** | |")
    names = {k for r in ranks for k in r["threads"]}
    for k in sorted(names, key=lambda k: -mean([r["threads"].get(k, 0) for r in ranks])):
        v = mean([r["threads"].get(k, 0) for r in ranks])
        sw = mean([r["switches"].get(k, 0) for r in ranks])
        if v >= 0.005 or sw >= 0.5:
            print(f"| {k} | {sw:.0f} | {v:.2f} | |")


def main() -> None:
    if os.environ.get("CPU_PER_PART_DIR"):
        return _rank_main(os.environ["CPU_PER_PART_DIR"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=60, help=f"iterations (> {ARM})")
    ap.add_argument("--none", action="store_true", help="the job without REFT")
    ap.add_argument("--parts", default="",
                    help="more parts to time, comma list of module:qualname (a function "
                         "is timed where that module's name is looked up)")
    ap.add_argument("extra", nargs="*", help="more pretrain_llama.py flags (after --)")
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    for part in [p for p in a.parts.split(",") if p]:  # here, not in 4 ranks' tracebacks
        try:
            _owner(part)
        except (ImportError, AttributeError, ValueError) as exc:
            sys.exit(f"error: --parts: {part!r} is not module:qualname of a function "
                     f"({exc})")
    if a.iters <= ARM + 1:
        sys.exit(f"error: --iters must be above {ARM + 1}")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import overhead_jobs as oj

    nproc, variants = oj.jobs(a.iters)["default"]
    argv = variants["none" if a.none else "reft"] + a.extra
    out = tempfile.mkdtemp(prefix="reft-cpu-per-part-")  # private (0700)
    job = f"cpp{os.getpid()}"
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), *argv]
    if not a.none:
        cmd += ["--reft-job-id", job]
    env = dict(os.environ, CPU_PER_PART_DIR=out, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               CPU_PER_PART_MORE=a.parts)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"the job failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")
        ms = [float(x) for it, x in oj.ELAPSED.findall(proc.stdout) if int(it) > ARM]
        _print(out, f"{'none' if a.none else 'reft'} {' '.join(a.extra)}".strip() +
               f" (median {statistics.median(ms):.1f} ms per iteration)" if ms else "")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(os.path.join("/dev/shm", f"reft-{job}"), ignore_errors=True)


if __name__ == "__main__":
    main()
