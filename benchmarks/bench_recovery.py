"""Recovery time: host memory (own / ARC replica / AEC decode) vs the persistent
checkpoint of the same iteration on local disk, in one run, plus the end-to-end split of
a restart (kill -> first iteration), and of a real node loss.

    python benchmarks/bench_recovery.py [--layers 24 --hidden 512] [--repeats 1]
                                        [--parts restore,node-loss]

restore: each scenario is a real 4-rank torchrun job (TP1 x PP2 x DP2, non-distributed
Adam) that snapshots every iteration and checkpoints at iteration 2; rank 1 is SIGKILLed
when iteration 3 begins (node-loss variants also wipe its shared memory) and torchrun
restarts the job. Restore times are the slowest rank's, as printed by the trainer.

node-loss: the same model and layout on 4 torchrun agents of one rank each
(tools/launch_nodes.py). Rank 1 freezes before its optimizer step of iteration 3, then
its node is lost as a whole (agent and worker SIGKILLed, shared memory removed) and a new
agent takes its slot; the survivors' agents see their workers fail, everyone
re-rendezvouses and REFT-load rebuilds rank 1's state (arc, aec, aec+aor with ZeRO-1),
or, without REFT, all ranks load the persistent checkpoint of iteration 2 (its pages
evicted at the kill: a cold read). The split comes from when each line appeared in the
logs (polled every 10 ms; agents run with LOGLEVEL=INFO) and from rank 0's own figures:
detect (kill -> rank 0's agent starts restarting: its worker failed, or the replacement
agent joined first), stop (-> the old workers are stopped), rendezvous (-> the new
workers start: includes the replacement agent's start), start-up (imports, process-group
init, model and optimizer), prepare (REFT's set-up before the restore: snapshot store
(re)allocation, groups, waiting for the slowest rank), load (REFT-load's verification,
agreement and exchange; or the checkpoint read), decode (AEC parity decode), rebuild
(state written back into the model and optimizer, data iterators) -> first iteration.
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
from reft_ext.progress import Progress  # noqa: E402
from tools.launch_nodes import LaunchConfig, NodeLauncher  # noqa: E402


def run(cmd_args, max_restarts=1):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
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


def drop_page_cache(path):
    """Evict a checkpoint's files from the page cache (fsync + POSIX_FADV_DONTNEED, no
    root needed), so loading it really reads the disk."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def scenario(model, ckpt, protect, fault):
    """Returns (restore seconds, end-to-end split dict)."""
    args = model + ["--reft-snapshot-every", "1", "--reft-protect", protect,
                    "--reft-ranks-per-node", "1", "--save", ckpt, "--save-interval", "2",
                    "--inject-fault", fault]
    lines = run(args)
    t_kill, _ = _first(lines, r"\[FAULT\] injecting")
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
            n += b"torch.distributed.run" in c and mine not in c
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


def node_loss(model, extra, tmp, tag) -> tuple[dict, str, bool]:
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
        wait_until_alone(L.job_id)
        tail = LogTail(L)
        L.start()
        tail.start()
        L.wait_for(r"\[FAULT\] injecting SIGSTOP into rank 1 ", timeout=900)
        t_kill = time.time()
        L.kill_node(1)
        L.replace_node(1)
        if extra is None:  # the replacement reads from storage: no page cache to help
            drop_page_cache(os.path.join(save, "iter_0000002"))
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
    load, (prepare, decode, write_back) = marks[i_load][1], (0.0, 0.0, 0.0)
    src = "persistent checkpoint"
    if extra is not None:  # rank 0's own REFT-load figures, measured after the arrival
        _, r = tail.first(r"\[REFT\] recovered iteration 2 on rank 0 .*\[this rank: verify"
                          r"\+agree ([0-9]+), exchange ([0-9]+), rebuild ([0-9]+), write back "
                          r"([0-9]+) ms\]", t_kill, node=0)
        verify, exchange, decode, write_back = (int(x) / 1e3 for x in r.groups())
        prepare, load = load - (verify + exchange + decode + write_back), verify + exchange
        src = tail.first(r"recovered iteration 2 on rank 1 from (.*?) \(", t_kill)[1].group(1)
    split = {"detect": t_fail - t_kill, "stop": t_stop - t_fail, "rendezvous": t_proc - t_stop,
             "start-up": sum(v for _, v in marks[:i_load]), "prepare": prepare,
             "load": load, "decode": decode,
             "rebuild": write_back + sum(v for _, v in marks[i_load + 1:]) +
             (t_first - t_proc - sum(v for _, v in marks)),
             "total": t_first - t_kill}
    return split, src, tail.disturbed


def node_loss_part(model, a, tmp, bar):
    rows, sources = {}, {}
    for rep in range(a.repeats):
        for i, (name, extra) in enumerate(NODE_LOSS):
            for attempt in range(3):  # a run that shared the host is run again
                split, src, disturbed = node_loss(model, extra, tmp, f"nl{rep}-{i}-{attempt}")
                bar.write(f"  [{name}, repeat {rep + 1}] " + ", ".join(
                    f"{k} {v:.2f}" for k, v in split.items()) +
                    ("" if not disturbed else " (another job ran meanwhile: " +
                     ("run again)" if attempt < 2 else "kept after 3 tries)")))
                if not disturbed:
                    break
            rows.setdefault(name, []).append(split)
            sources[name] = src
            bar.update()
    with bar.paused():
        node_loss_table(a, rows, sources)


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
    ap.add_argument("--repeats", type=int, default=1)
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
    rows = {}
    for rep in range(a.repeats):
        for name, protect, fault in [("host memory, own", "arc", "1:3"),
                                     ("host memory, ARC replica", "arc", "1:3:KILL:node"),
                                     ("host memory, AEC decode", "aec", "1:3:KILL:node")]:
            ckpt = os.path.join(tmp, f"{rep}-{protect}-{len(fault)}")
            secs, src, split = scenario(model, ckpt, protect, fault)
            rows.setdefault(name, []).append((secs, split, src))
            bar.update()
        # the persistent checkpoint of the same iteration (2), loaded on restart (the
        # job also wrote a final one at 3: point the tracker back at 2)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        for name, cold in [("persistent checkpoint, page cache", False),
                           ("persistent checkpoint, local disk", True)]:
            if cold:
                drop_page_cache(os.path.join(ckpt, "iter_0000002"))
            lines = run(model + ["--load", ckpt, "--train-iters", "3"], max_restarts=0)
            _, m = _first(lines, r"loaded checkpoint .* at iteration 2 \[([0-9.]+) s\]")
            rows.setdefault(name, []).append((float(m.group(1)), None, None))
            bar.update()
    with bar.paused():
        restore_table(a, rows)


def restore_table(a, rows):
    state_mb = a.layers * 12 * a.hidden ** 2 * 4 * 3 / 2 ** 20
    print(f"\nrestore of the training state (~{state_mb:.0f} MiB params+Adam, TP1xPP2xDP2, "
          f"4 ranks; median of {a.repeats}; slowest rank)")
    disk = statistics.median(s for s, _, _ in rows["persistent checkpoint, local disk"])
    print(f"{'source':36s} {'seconds':>9s} {'speed-up vs local disk':>23s}")
    for name, vals in rows.items():
        sec = statistics.median(s for s, _, _ in vals)
        print(f"{name:36s} {sec:9.3f} {disk / sec:22.1f}x")
    print("\nend-to-end recovery of a crash (kill -> first iteration), seconds:")
    for name, vals in rows.items():
        if vals[0][1] is None:
            continue
        split = vals[len(vals) // 2][1]
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))


if __name__ == "__main__":
    main()
