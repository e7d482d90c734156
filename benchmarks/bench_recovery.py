"""Recovery time: host memory (own / ARC replica / AEC decode) vs the persistent
checkpoint of the same iteration on local disk, in one run, plus the end-to-end split of
a restart (kill -> first iteration), and of a real node loss.

    python benchmarks/bench_recovery.py [--layers 24 --hidden 512] [--repeats 3]
                                        [--parts restore,node-loss]

restore: each scenario is a real 4-rank torchrun job (TP1 x PP2 x DP2, non-distributed
Adam) that snapshots every iteration and checkpoints at iteration 2; rank 1 is SIGKILLed
when iteration 3 begins (node-loss variants also wipe its shared memory) and torchrun
restarts the job. The persistent rows load that job's checkpoint of the same iteration in
a new job, its files first read into the page cache, then evicted (POSIX_FADV_DONTNEED,
checked with mincore(2): benchmarks/page_cache.py). Both sides are timed the same way by
the trainer: the clock starts after a barrier (the ranks' arrival skew is not counted) and
the figure is the slowest rank's (REFT-load: reft_ext/load/recover.py; the persistent load:
megatron/training/checkpointing.py). The five sources take turns (A B C D E A B C D E
...), medians over --repeats.

node-loss: the same model and layout on 4 torchrun agents of one rank each
(tools/launch_nodes.py). Rank 1 freezes before its optimizer step of iteration 3, then
its node is lost as a whole (agent and worker SIGKILLed, shared memory removed) and a new
agent takes its slot; the survivors' agents see their workers fail, everyone
re-rendezvouses and REFT-load rebuilds rank 1's state (arc, aec, aec+aor with ZeRO-1),
or, without REFT, all ranks load the persistent checkpoint of iteration 2 (its pages
evicted at the kill and checked to be out of the page cache: a cold read). The split
comes from when each line appeared in the logs (polled every 10 ms; agents run with
LOGLEVEL=INFO) and from the trainer's own figures:
detect (kill -> rank 0's agent starts restarting: its worker failed, or the replacement
agent joined first), stop (-> the old workers are stopped), rendezvous (-> the new
workers start: includes the replacement agent's start), start-up (imports, process-group
init, model and optimizer), prepare (before the timed restore: REFT's snapshot store
(re)allocation and groups, the tracker read, waiting for the slowest rank), load (the
slowest rank's restore after a barrier, the same rule on both sides: REFT-load's
verification, agreement, exchange and write-back into model and optimizer, less the
decode; or the checkpoint read into model and optimizer), decode (AEC parity decode, the
slowest rank's), rebuild (data iterators, on_start) -> first iteration.
"restart" in the usual sense is stop + start-up.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks import page_cache  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402
from tools.launch_nodes import LaunchConfig, NodeLauncher  # noqa: E402


def run(cmd_args, max_restarts=1):
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=4", f"--max-restarts={max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *cmd_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.time(), line))
    proc.wait()
    if proc.returncode != 0:
        sys.exit("".join(ln for _, ln in lines[-60:]))
    return lines


def _first(lines, pattern, after=0.0):
    for t, line in lines:
        if t >= after:
            m = re.search(pattern, line)
            if m:
                return t, m
    return None, None


def drop_page_cache(path) -> tuple[int, int]:
    """Evict a checkpoint's files from the page cache and return (resident, total) pages
    as mincore sees them afterwards: a cold read is only reported as one when checked."""
    got, total = page_cache.drop(path)
    if got:
        print(f"  warning: {page_cache.describe(got, total)} of {path} after "
              f"POSIX_FADV_DONTNEED: that read is partly warm", flush=True)
    return got, total


def scenario(model, ckpt, protect, fault):
    """Returns (restore seconds, end-to-end split dict)."""
    args = model + ["--reft-snapshot-every", "1", "--reft-protect", protect,
                    "--reft-ranks-per-node", "1", "--save", ckpt, "--save-interval", "2",
                    "--inject-fault", fault]
    lines = run(args)
    t_kill, _ = _first(lines, r"\[FAULT\] injecting")
    if t_kill is None:
        sys.exit(f"bench_recovery: --inject-fault {fault} never fired ({protect}):\n"
                 + "".join(ln for _, ln in lines[-40:]))
    ms = [float(m.group(1)) for _, ln in lines
          for m in [re.search(r"\[REFT\] recovered iteration \d+ on rank \d+ from .* in "
                              r"([0-9.]+) ms", ln)] if m]
    src = sorted({m.group(1) for _, ln in lines
                  for m in [re.search(r"rank 1 from (.*?) \(", ln)] if m})
    t_start, m = _first(lines, r"time from process start to first iteration: ([0-9.]+) s "
                               r"\((.*) s\)", after=t_kill)
    t_it, _ = _first(lines, r"iteration +3/", after=t_kill)
    split = dict(p.rsplit(" ", 1) for p in m.group(2).split(", "))
    return max(ms) / 1000.0, src, {"kill -> first iteration": t_it - t_kill,
                                   "worker start -> first iteration": float(m.group(1)),
                                   **{k: float(v) for k, v in split.items()}}


def foreign_agents(job_id: str) -> int:
    """torchrun agents of other jobs on this host (someone else's tests): on 2 cores their
    load would be measured as this job's recovery time."""
    mine, n = f"--rdzv-id={job_id}".encode(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    c = f.read()
            except OSError:
                continue
            n += (b"torch.distributed.run" in c or b"reft_ext.cluster.torchrun" in c) and \
                mine not in c
    return n


def wait_until_alone(job_id: str) -> None:
    said = False
    while foreign_agents(job_id):
        if not said:
            print("  (waiting for other torchrun jobs on this host to end)", flush=True)
            said = True
        time.sleep(5)


class LogTail(threading.Thread):
    """Every line the nodes' agents and workers print, stamped with when it appeared:
    node logs are files (one per agent start), and the split needs when things happened."""

    def __init__(self, launcher: NodeLauncher):
        super().__init__(daemon=True)
        self.L, self.lines, self.done = launcher, [], threading.Event()
        self._pos: dict[str, tuple[int, bytes]] = {}
        self.disturbed = False  # another job's agents ran at some point

    def run(self):
        n = 0
        while not self.done.is_set():
            self.poll()
            if n % 100 == 0:
                self.disturbed |= foreign_agents(self.L.job_id) > 0
            n += 1
            time.sleep(0.01)
        self.poll()

    def poll(self):
        now = time.time()
        for node, paths in list(self.L.logs.items()):
            for path in list(paths):
                pos, rest = self._pos.get(path, (0, b""))
                try:
                    with open(path, "rb") as f:
                        f.seek(pos)
                        data = f.read()
                except OSError:
                    continue
                *full, rest = (rest + data).split(b"\n")
                self._pos[path] = (pos + len(data), rest)
                self.lines += [(now, node, ln.decode(errors="replace")) for ln in full]

    def first(self, pattern: str, after: float = 0.0, node: int | None = None):
        for t, n, line in self.lines:
            if t >= after and (node is None or n == node):
                m = re.search(pattern, line)
                if m:
                    return t, m
        raise RuntimeError(f"no {pattern!r} in the logs of node {node} after the kill")


NODE_LOSS = [  # (name, extra args); the survivors' save-on-failure flush is off: it
    # writes their snapshots to disk while they restart, which is not REFT-load's cost
    ("arc", ["--reft-protect", "arc"]),
    ("aec", ["--reft-protect", "aec"]),
    ("aec+aor (ZeRO-1)", ["--reft-protect", "aec,aor", "--use-distributed-optimizer"]),
    ("persistent only (no REFT)", None),
]
COLUMNS = ("detect", "stop", "rendezvous", "start-up", "prepare", "load", "decode", "rebuild",
           "total")


def node_loss(model, extra, tmp, tag, shared=False) -> tuple[dict, str, bool]:
    """One node loss and recovery; returns (split in seconds, rank 1's source, whether
    another job ran on the host meanwhile)."""
    save = os.path.join(tmp, f"{tag}-ckpt")
    args = model + ["--inject-fault", "1:3:STOP"]
    if extra is None:
        args += ["--save", save, "--load", save, "--save-interval", "2"]
    else:
        args += ["--reft-snapshot-every", "1", "--reft-flush-dir", "none", *extra]
    cfg = LaunchConfig(nnodes=4, nproc_per_node=1, max_restarts=1,
                       log_dir=os.path.join(tmp, f"{tag}-logs"))
    with NodeLauncher(cfg, args, env={"LOGLEVEL": "INFO"}) as L:
        if not shared:
            wait_until_alone(L.job_id)
        tail = LogTail(L)
        L.start()
        tail.start()
        L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 1 ", timeout=900)
        t_kill = time.time()
        L.kill_node(1)
        L.replace_node(1)
        cached = None
        if extra is None:  # the replacement reads from storage: no page cache to help
            got, total = drop_page_cache(os.path.join(save, "iter_0000002"))
            cached = f"{100 * got / max(total, 1):.1f}% of its pages cached after the kill"
        codes = L.wait(1800)
        tail.done.set()
        tail.join()
        L.cleanup_shm()
        if any(codes.values()):
            sys.exit(f"node-loss run {tag} failed: {codes}\n{L.outputs()[-6000:]}")
    # the agent restarts because its workers FAILED, or because the replacement agent
    # joined the rendezvous first ("Detected 1 new nodes"): either way it stops them
    t_fail, _ = tail.first(r"Stopping worker group", t_kill, node=0)
    t_stop, _ = tail.first(r"Rendezvous'ing worker group", t_fail, node=0)
    t_first, m = tail.first(r"time from process start to first iteration: ([0-9.]+) s "
                            r"\((.*) s\)", t_kill, node=0)
    marks = [(k, float(v)) for k, v in (p.rsplit(" ", 1) for p in m.group(2).split(", "))]
    names = [k for k, _ in marks]
    t_proc, i_load = t_first - float(m.group(1)), names.index("load")
    # both sides' restore as the trainer times it: after a barrier, the slowest rank
    decode = 0.0
    if extra is None:
        _, r = tail.first(r"loaded checkpoint .* at iteration 2 \[([0-9.]+) s, slowest rank\]",
                          t_kill, node=0)
        restore, src = float(r.group(1)), f"persistent checkpoint ({cached})"
    else:
        _, r = tail.first(r"\[REFT\] recovery: iteration 2 restored on \d+ ranks from .* in "
                          r"([0-9.]+) ms", t_kill, node=0)
        restore = float(r.group(1)) / 1e3
        decode = max((int(d.group(1)) / 1e3 for t, _, ln in tail.lines if t >= t_kill
                      for d in [re.search(r"recovered iteration 2 on rank \d+ .*, rebuild "
                                          r"([0-9]+), write back", ln)] if d), default=0.0)
        src = tail.first(r"recovered iteration 2 on rank 1 from (.*?) \(", t_kill)[1].group(1)
    split = {"detect": t_fail - t_kill, "stop": t_stop - t_fail, "rendezvous": t_proc - t_stop,
             "start-up": sum(v for _, v in marks[:i_load]),
             "prepare": marks[i_load][1] - restore, "load": restore - decode, "decode": decode,
             "rebuild": sum(v for _, v in marks[i_load + 1:]) +
             (t_first - t_proc - sum(v for _, v in marks)),
             "total": t_first - t_kill}
    return split, src, tail.disturbed


def node_loss_part(model, a, tmp, bar):
    rows, sources, shared_runs = {}, {}, 0
    tries = 1 if a.shared_host else 3
    for rep in range(a.repeats):
        for i, (name, extra) in enumerate(NODE_LOSS):
            for attempt in range(tries):  # a run that shared the host is run again
                split, src, disturbed = node_loss(model, extra, tmp, f"nl{rep}-{i}-{attempt}",
                                                  a.shared_host)
                bar.write(f"  [{name}, repeat {rep + 1}] " + ", ".join(
                    f"{k} {v:.2f}" for k, v in split.items()) +
                    ("" if not disturbed else " (another job ran meanwhile: " +
                     ("run again)" if attempt < tries - 1 else f"kept after {tries} "
                                                                f"tries)")))
                if not disturbed:
                    break
            rows.setdefault(name, []).append(split)
            sources[name], shared_runs = src, shared_runs + disturbed
            bar.update()
    with bar.paused():
        node_loss_table(a, rows, sources)
        if shared_runs:
            print(f"{shared_runs} of {len(rows) * a.repeats} runs shared the host with other "
                  f"torchrun jobs")


def node_loss_table(a, rows, sources):
    print(f"\nnode loss, kill -> first iteration after recovery, seconds (median of "
          f"{a.repeats} per column; 4 agents x 1 rank, TP1xPP2xDP2, node 1 lost and "
          f"replaced)")
    print(f"{'scenario':27s}" + "".join(f"{c:>11s}" for c in COLUMNS) + "  rank 1 from")
    for name, splits in rows.items():
        print(f"{name:27s}" + "".join(f"{statistics.median(s[c] for s in splits):11.2f}"
                                      for c in COLUMNS) + f"  {sources[name]}")
    print("| scenario | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS))
    for name, splits in rows.items():  # the same table for docs/nodes.md
        print(f"| {name} | " + " | ".join(f"{statistics.median(s[c] for s in splits):.2f}"
                                          for c in COLUMNS) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="1.3B preset's layer count")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds (medians reported)")
    ap.add_argument("--shared-host", action="store_true",
                    help="node-loss: do not wait for other torchrun jobs on this host to end "
                         "nor run a disturbed run again (their load is in the figures)")
    ap.add_argument("--parts", default="restore,node-loss",
                    help="comma list: restore (memory vs disk), node-loss (end-to-end split)")
    a = ap.parse_args()
    # stopped from outside (even when started in the background, where SIGINT is ignored):
    # unwind, so that every NodeLauncher kills the agents and workers it started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_recovery: terminated"))
    parts = set(a.parts.split(","))
    if not parts or parts - {"restore", "node-loss"}:
        ap.error(f"--parts: choose from restore, node-loss; got {a.parts!r}")
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", "8", "--seq-length", "64", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
             "--micro-batch-size", "1", "--global-batch-size", "4",
             "--pipeline-model-parallel-size", "2", "--train-iters", "3",
             "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0"]
    # one progress line (stderr) over all runs: 5 per restore repeat, 4 per node-loss one
    runs = a.repeats * (5 * ("restore" in parts) + len(NODE_LOSS) * ("node-loss" in parts))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", REPO)) as tmp, \
            Progress(runs, "bench_recovery", unit="run") as bar:
        if "restore" in parts:
            restore_part(model, a, tmp, bar)
        if "node-loss" in parts:
            node_loss_part(model, a, tmp, bar)


def restore_part(model, a, tmp, bar):
    rows, cache = {}, {}
    for rep in range(a.repeats):  # interleaved: every source once per round
        for name, protect, fault in [("host memory, own", "arc", "1:3"),
                                     ("host memory, ARC replica", "arc", "1:3:KILL:node"),
                                     ("host memory, AEC decode", "aec", "1:3:KILL:node")]:
            ckpt = os.path.join(tmp, f"{rep}-{protect}-{len(fault)}")
            secs, src, split = scenario(model, ckpt, protect, fault)
            rows.setdefault(name, []).append((secs, split, src))
            bar.update()
        # the persistent checkpoint of the same iteration (2), loaded by a new job (the
        # job also wrote a final one at 3: point the tracker back at 2)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        it2 = os.path.join(ckpt, "iter_0000002")
        for name, cold in [("persistent checkpoint, page cache", False),
                           ("persistent checkpoint, local disk", True)]:
            got, total = drop_page_cache(it2) if cold else page_cache.warm(it2)
            cache.setdefault(name, []).append(got / max(total, 1))
            lines = run(model + ["--load", ckpt, "--train-iters", "3"], max_restarts=0)
            _, m = _first(lines, r"loaded checkpoint .* at iteration 2 \[([0-9.]+) s, "
                                 r"slowest rank\]")
            rows.setdefault(name, []).append((float(m.group(1)), None, None))
            bar.update()
    with bar.paused():
        restore_table(a, rows, cache)


def restore_table(a, rows, cache):
    state_mb = a.layers * 12 * a.hidden ** 2 * 4 * 3 / 2 ** 20
    print(f"\nrestore of the training state (~{state_mb:.0f} MiB params+Adam, TP1xPP2xDP2, "
          f"4 ranks; slowest rank, clock started after a barrier on both sides; "
          f"{a.repeats} interleaved rounds, median)")
    disk = statistics.median(s for s, _, _ in rows["persistent checkpoint, local disk"])
    print(f"{'source':36s} {'median s':>9s} {'vs local disk':>14s}   every round (s)")
    for name, vals in rows.items():
        sec = statistics.median(s for s, _, _ in vals)
        print(f"{name:36s} {sec:9.3f} {disk / sec:13.1f}x   "
              + " ".join(f"{s:.3f}" for s, _, _ in vals))
    for name, fr in cache.items():
        print(f"  {name}: {', '.join(f'{100 * x:.1f}%' for x in fr)} of the checkpoint's "
              f"pages in the page cache before the load (mincore)")
    print("| source | median s | vs local disk | every round (s) |\n|---|---|---|---|")
    for name, vals in rows.items():  # the same table for docs/reft.md
        sec = statistics.median(s for s, _, _ in vals)
        print(f"| {name} | {sec:.3f} | {disk / sec:.1f}x | "
              + " / ".join(f"{s:.3f}" for s, _, _ in vals) + " |")
    print("\nend-to-end recovery of a crash (kill -> first iteration), seconds (the round "
          "with the median restore):")
    for name, vals in rows.items():
        if vals[0][1] is None:
            continue
        split = sorted(vals, key=lambda v: v[0])[len(vals) // 2][1]
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
