"""REFT's added time per iteration against world size (issue 34).

    python benchmarks/bench_world_size.py [--sizes 4,8,16,32] [--repeats 1] [--iters 16]

The same tiny job (PP2 x DP W/2, distributed optimizer, 2 micro-batches per pipeline) at
each world size W on loopback gloo, REFT off and on (snapshots every iteration, arc +
aor, two ranks per simulated node: a pipeline's two stages), and REFT on with
``--reft-keep 2`` (a job-wide all-reduce per commit: the baseline of local commits),
runs interleaved. W > 2 oversubscribes this 2-core host, so the wall-clock difference
alone is noise; beside it the table reports what does not depend on the machine's load as
much: the time the training thread spends inside REFT's hooks per iteration, wall and CPU
(the wall time grows with the ranks waiting for one of the two cores, the CPU time only
with REFT's work), of it the time inside REFT's collectives of the whole job, and every
collective REFT issues per iteration with its group size and bytes
(REFT_COUNT_COLLECTIVES=1, reft_ext/testing/collectives.py). Medians over the iterations
after the first log line; REFT's time: the median rank's and the slowest rank's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.progress import Progress  # noqa: E402  (progress with ETA on stderr)

LOG = 4  # the log line's average per iteration; REFT gathers its line's statistics then
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
         "--micro-batch-size", "1", "--lr", "1e-4", "--log-interval", str(LOG),
         "--eval-iters", "0", "--eval-interval", "100000", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--use-tp-pp-dp-mapping"]
REFT = ["--reft-snapshot-every", "1", "--reft-protect", "arc,aor",
        "--reft-ranks-per-node", "2", "--reft-keep", "3"]
WARMUP = LOG  # the first log line's iterations are the warm-up
ITER_MS = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)")
P2P = {"send", "recv", "isend", "irecv"}


def run(world: int, reft: bool | list, iters: int) -> dict:
    """One job; {"iter_ms": median, "reft_ms": (median rank, slowest rank), "calls": ...}."""
    fd, events = tempfile.mkstemp(prefix="bench-world-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               REFT_EVENTS_FILE=events, REFT_COUNT_COLLECTIVES="1" if reft else "0")
    args = [*MODEL, "--train-iters", str(iters), "--global-batch-size", str(world)]
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={world}", os.path.join(REPO, "pretrain_llama.py"), *args,
           *((REFT + (reft if isinstance(reft, list) else [])) if reft else [])]
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=1800)
        if out.returncode:
            first = out.stderr.find("Traceback")  # the first rank's error, not torchrun's
            raise RuntimeError(f"W={world} reft={reft} failed:\n{out.stdout[-3000:]}"
                               f"{out.stderr[max(first, 0):][:4000]}")
        with open(events) as f:
            evs = [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(events)
    ms = [float(m) for i, m in ITER_MS.findall(out.stdout) if int(i) > WARMUP]
    res = {"iter_ms": statistics.median(ms) if ms else float("nan")}
    steady = [e for e in evs if e["event"] == "reft_iteration" and e["iteration"] > WARMUP]
    if steady:
        per_rank, cpu = collections.defaultdict(list), collections.defaultdict(list)
        for e in steady:
            per_rank[e["rank"]].append(e["reft_ms"])
            cpu[e["rank"]].append(e["reft_cpu_ms"])
        meds = sorted(statistics.median(v) for v in per_rank.values())
        res["reft_ms"] = (statistics.median(meds), meds[-1])
        res["cpu_ms"] = statistics.median(statistics.median(v) for v in cpu.values())
        world_ms = collections.defaultdict(list)  # inside REFT's world-wide collectives
        for e in steady:
            world_ms[e["rank"]].append(sum(c["ms"] for c in e["calls"] if
                                           c["group_size"] == world and c["op"] not in P2P))
        res["world_ms"] = statistics.median(statistics.median(v) for v in world_ms.values())
        mine = [e for e in steady if e["rank"] == 0]
        count = collections.Counter()
        for e in mine:
            for c in e["calls"]:
                count[(c["where"], c["op"], c["group_size"], c["bytes"])] += 1
        res["calls"] = {k: v / len(mine) for k, v in count.items()}
        res["world_wide"] = sum(v for (w, op, size, _), v in res["calls"].items()
                                if size == world and op not in P2P)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,8,16,32")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds (medians)")
    ap.add_argument("--iters", type=int, default=16, help="a multiple of 4")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    results = collections.defaultdict(list)
    modes = [False, True, "keep2"]  # REFT off, on (local commits), on with --reft-keep 2
    todo = [(r, w, on) for r in range(a.repeats) for w in sizes
            for on in (modes if (r + w) % 2 == 0 else modes[::-1])]
    bar = Progress(len(todo), "bench_world_size", unit="run")
    for r, w, on in todo:
        # (a later --reft-keep wins: REFT's own flags put 3 first)
        results[(w, on)].append(run(w, ["--reft-keep", "2"] if on == "keep2" else on,
                                    a.iters))
        bar.update(1)
    print(f"\nREFT's added cost per iteration against world size (tiny job, PP2 x DP W/2, "
          f"ZeRO-1, arc+aor, 2 ranks per simulated node; medians of {a.repeats} "
          f"interleaved rounds, iterations > {WARMUP}; this 2-core host)\n")
    print("| ranks | iteration off (ms) | on (ms) | added (ms) | REFT hooks on the training "
          "thread (ms; median rank / slowest) | their CPU time (ms, median rank) | of it in "
          "REFT's world-wide collectives (ms, median rank) | REFT world-wide collectives per "
          "iteration | --reft-keep 2: added (ms), hooks (median / slowest), CPU, world-wide "
          "(ms), per iteration |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in sizes:
        off = statistics.median(x["iter_ms"] for x in results[(w, False)])
        cols = []
        for mode in (True, "keep2"):
            on = results[(w, mode)]
            on_ms = statistics.median(x["iter_ms"] for x in on)
            med = statistics.median(x["reft_ms"][0] for x in on)
            slow = statistics.median(x["reft_ms"][1] for x in on)
            world = statistics.median(x["world_wide"] for x in on)
            world_ms = statistics.median(x["world_ms"] for x in on)
            cpu = statistics.median(x["cpu_ms"] for x in on)
            cols.append((on_ms, on_ms - off, med, slow, cpu, world_ms, world))
        (on_ms, added, med, slow, cpu, world_ms, world), k2 = cols
        print(f"| {w} | {off:.1f} | {on_ms:.1f} | {added:+.1f} | {med:.2f} / {slow:.2f} "
              f"| {cpu:.2f} | {world_ms:.2f} | {world:g} | {k2[1]:+.1f}, {k2[2]:.2f} / "
              f"{k2[3]:.2f}, {k2[4]:.2f}, {k2[5]:.2f}, {k2[6]:g} |")
    print("\nREFT's calls into torch.distributed per iteration (rank 0; where, op, group "
          "size, bytes: calls per iteration)")
    for w in sizes:
        calls = results[(w, True)][-1]["calls"]
        print(f"  {w} ranks: " + "; ".join(
            f"{where} {op} group {size} {nbytes} B x{n:.2f}"
            for (where, op, size, nbytes), n in sorted(calls.items())))


if __name__ == "__main__":
    main()
