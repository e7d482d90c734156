"""Downtime per failure: process restart vs in-process restart vs in-process with a warm
spare, side by side in one run (also `bench_recovery.py --parts downtime`).

    python benchmarks/bench_downtime.py [--repeats 3] [--scenarios crash,node] [--slurm]

--slurm adds the rows of a real Slurm (benchmarks/downtime_slurm.py: four local slurmd,
tiny_cpu.sbatch in both restart modes, 2 nodes + a spare node; root and slurm-wlm needed)
for the same two failures: a crash, and a node lost from outside.

crash: the tiny default job (`make run`'s flags, 4 ranks, TP1xPP2xDP2 ZeRO-1, arc,aor,
each rank its own failure domain); rank 1 is SIGKILLed before its optimizer step of
iteration 5 (``--inject-fault 1:5``). node: 24 layers x hidden 512, TP1xPP2xDP2; rank 1
is SIGKILLed at iteration 3 and its failure domain's shared memory removed
(``1:3:KILL:node``), so it is restored from its peers (ARC replica).

Modes: process = torchrun (--standalone, --max-restarts 1) restarts every worker;
in-process = tools/launch_nodes.py --restart in-process: survivors stay, the dead rank's
replacement starts cold; + warm spare = the same with ``--spares 1``.

Two figures per run, both from the fault's moment (its ``fault`` event, written just
before the signal): resume = until every rank is back in the training loop with the
restored state (its ``resume`` event: the first step begins; what bench_recovery.py's
node-loss "total" measured), and downtime = until the end of the first iteration after
the restored one (the ``iteration`` event), i.e. resume plus one iteration; beside the
first iteration after the recovery, the median iteration before the fault (warm-up
left out), the steady state it should match. The split,
from the processes' own events: process mode: restart (kill -> the new processes
exist), imports, init (process groups, health check), build (model, optimizer), load
(REFT-load), data, start (the hooks' on_start: AOR replicas), first iteration;
in-process: abort (kill -> every survivor out of the failed generation), wait (-> the
next generation published: the replacement assigned), rendezvous (-> new process
groups: includes a cold replacement's imports), rejoin (the replacement's build
replayed, REFT-load, data), start, first iteration. Medians over interleaved rounds
(A B C A B C ...); every round is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.events import read as read_events  # noqa: E402
from reft_ext.report.files import open_nofollow  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402
from tools.inprocess_launcher import InProcessLauncher  # noqa: E402
from tools.launch_nodes import LaunchConfig  # noqa: E402
from benchmarks.downtime_slurm import MODES as SLURM_MODES, Cluster  # noqa: E402

REFT = ["--reft-snapshot-every", "1", "--reft-protect", "arc,aor", "--reft-ranks-per-node",
        "1", "--log-interval", "1", "--eval-iters", "0", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
SCENARIOS = {
    "crash": (["--model-size", "tiny", "--pipeline-model-parallel-size", "2",
               "--use-distributed-optimizer", "--micro-batch-size", "4",
               "--global-batch-size", "32", "--train-iters", "7", *REFT], "1:5"),
    "node": (["--num-layers", "24", "--hidden-size", "512", "--num-attention-heads", "8",
              "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
              "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
              "--train-iters", "4", "--lr-warmup-iters", "0", *REFT], "1:3:KILL:node"),
}
MODES = ("process", "in-process", "in-process + warm spare")


def _env(events: str) -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
                REFT_EVENTS_FILE=events, PYTHONPATH=REPO)


def run_process(args: list[str], events: str, tmp: str) -> None:
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=4", "--max-restarts=1", os.path.join(REPO, "pretrain_llama.py"),
           *args]
    log = os.path.join(tmp, "torchrun.log")
    with open_nofollow(log) as f:
        rc = subprocess.call(cmd, cwd=REPO, env=_env(events), stdout=f,
                             stderr=subprocess.STDOUT, timeout=900)
    if rc:
        sys.exit(f"torchrun failed ({rc}):\n{open(log).read()[-6000:]}")


def run_inprocess(args: list[str], events: str, tmp: str, spares: int) -> None:
    cfg = LaunchConfig(nnodes=4, nproc_per_node=1, restart="in-process", spares=spares,
                       max_restarts=1, log_dir=tempfile.mkdtemp(dir=tmp))
    with InProcessLauncher(cfg, args, env={"REFT_EVENTS_FILE": events}) as L:
        L.start()
        codes = L.wait(900)
        if any(codes.values()):
            sys.exit(f"in-process job failed ({L.sup.failure}):\n{L.outputs()[-6000:]}")


def split(events: list[dict], mode: str) -> dict:
    """Seconds of each step of the one recovery in ``events`` (see the docstring)."""
    fault = next(e for e in events if e["event"] == "fault")
    t_kill = fault["time"]
    restored = min(e["iteration"] for e in events
                   if e["event"] == "recovered" and e["time"] > t_kill)
    t_next = min(e["time"] for e in events if e["event"] == "iteration"
                 and e["time"] > t_kill and e["iteration"] == restored + 1)
    t_resume = max(e["time"] for e in events if e["event"] == "resume" and e["time"] > t_kill)
    out = {}
    if mode == "process":
        start = next(e for e in events if e["event"] == "startup" and e["time"] > t_kill
                     and e["rank"] == 0)
        marks = dict(start["marks"])
        t_proc = start["process_start"]
        out["restart"] = t_proc - t_kill
        out["imports"] = marks["imports"] - t_proc
        t_init = marks.get("health check", marks["distributed init"])
        out["init"] = t_init - marks["imports"]
        out["build"] = marks["model+optimizer"] - t_init
        out["load"] = marks["load"] - marks["model+optimizer"]
        out["data"] = marks["data"] - marks["load"]
        out["start"] = t_resume - marks["data"]
    else:
        aborts = [e for e in events if e["event"] == "inprocess_abort"]
        done = [e for e in events if e["event"] == "inprocess_restart"]
        t_abort = max(e["time"] for e in aborts)
        t_done = max(e["time"] for e in done)
        wait = max(e["wait_generation_s"] for e in done)
        rdzv = max(e["rendezvous_s"] for e in done)
        out["abort"] = t_abort - t_kill
        out["wait"] = wait
        out["rendezvous"] = rdzv
        out["rejoin"] = t_done - t_abort - wait - rdzv
        out["start"] = t_resume - t_done
    out["first iteration"] = t_next - t_resume
    # the steady state it is compared with: iterations ended before the fault, the first
    # two (warm-up) left out
    # (one rank's: every rank of the last stage records its iterations)
    its = [e for e in events if e["event"] == "iteration" and e["time"] < t_kill]
    one = min((e["rank"] for e in its), default=None)
    before = sorted(e["time"] for e in its if e["rank"] == one)[1:]
    if len(before) >= 3:
        out["median iteration before"] = statistics.median(
            b - a for a, b in zip(before, before[1:]))
    out["resume"] = t_resume - t_kill
    out["downtime"] = t_next - t_kill
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--scenarios", default="crash,node", help="comma list: crash, node")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " +
                    ", ".join(MODES + SLURM_MODES))
    ap.add_argument("--slurm", action="store_true", help="add the modes of a real Slurm")
    a = ap.parse_args()
    names = a.scenarios.split(",")
    modes = [m for m in a.modes.split(",") if m] + (list(SLURM_MODES) if a.slurm else [])
    if set(names) - set(SCENARIOS) or set(modes) - set(MODES) - set(SLURM_MODES):
        ap.error(f"--scenarios from {list(SCENARIOS)}, --modes from {list(MODES + SLURM_MODES)}")
    rows: dict = {}
    cluster = Cluster() if any(m in SLURM_MODES for m in modes) else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, cluster as slurm, \
            Progress(a.repeats * len(names) * len(modes), "bench_downtime", unit="run") as bar:
        for rep in range(a.repeats):
            for name in names:
                args, fault = SCENARIOS[name]
                for mode in modes:
                    events = os.path.join(tmp, f"{name}-{rep}-{len(mode)}.jsonl")
                    open_nofollow(events).close()
                    job = [*args, "--inject-fault", fault]
                    if mode in SLURM_MODES:
                        slurm.run(name, mode, events, tmp)
                    elif mode == "process":
                        run_process(job, events, tmp)
                    else:
                        run_inprocess(job, events, tmp, spares=int("spare" in mode))
                    s = split(read_events(events), "process" if mode == "slurm torchrun"
                              else mode)
                    rows.setdefault((name, mode), []).append(s)
                    bar.write(f"  [{name}, {mode}, round {rep + 1}] " +
                              ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
                    bar.update()
    for name in names:
        def med(mode, key):
            return statistics.median(s[key] for s in rows[(name, mode)])
        print(f"\n{name}: seconds from the fault (median of {a.repeats}; 4 ranks on this "
              f"host; the slurm rows: tiny_cpu.sbatch, 2 ranks on 2 Slurm nodes + a spare): "
              f"resume = every rank training again, downtime = + the first iteration")
        print("| mode | resume | downtime | vs process or slurm torchrun (resume, downtime) "
              "| split (medians) "
              "| every round (resume / downtime) |")
        print("|---|---|---|---|---|---|")
        for mode in modes:
            ss = rows[(name, mode)]
            parts = ", ".join(f"{k} {med(mode, k):.2f}" for k in ss[0]
                              if k not in ("resume", "downtime"))
            ref = "slurm torchrun" if mode in SLURM_MODES else "process"
            ratio = (f"{med(ref, 'resume') / med(mode, 'resume'):.1f}x, "
                     f"{med(ref, 'downtime') / med(mode, 'downtime'):.1f}x"
                     if (name, ref) in rows else "-")
            print(f"| {mode} | {med(mode, 'resume'):.2f} | {med(mode, 'downtime'):.2f} | "
                  f"{ratio} | {parts} | " +
                  " / ".join(f"{s['resume']:.2f}/{s['downtime']:.2f}" for s in ss) + " |")


if __name__ == "__main__":
    main()
