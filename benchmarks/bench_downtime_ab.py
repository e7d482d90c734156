"""Downtime of this checkout against an earlier commit, interleaved in one run.

    python benchmarks/bench_downtime_ab.py --base REV [--repeats 6] [--scenario node]
        [--mode "in-process + warm spare"]

A change to the rejoin is judged against the code before it on the same host at the
same time (these machines are noisy: a neighbour's load moves every figure). The base is
checked out into a temporary git worktree (with this checkout's built extensions copied
in), and the rounds alternate: base, this checkout, base, ... each one
``bench_downtime.py --repeats 1`` run with its own tree first on PYTHONPATH. Prints every
round and the medians of each step of the split side by side.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND = re.compile(r"\] (.*)$")


def one_round(tree: str, scenario: str, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bench_downtime.py"),
                          "--repeats", "1", "--scenarios", scenario, "--modes", mode],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        sys.exit(f"bench_downtime.py in {tree} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() + out.stderr.splitlines()
                if f"[{scenario}, {mode}, round 1]" in ln)
    parts = ROUND.search(line).group(1).split(", ")
    return {k: float(v) for k, v in (p.rsplit(" ", 1) for p in parts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=6, help="rounds of each (medians)")
    ap.add_argument("--scenario", default="node", help="crash or node (bench_downtime.py)")
    ap.add_argument("--mode", default="in-process + warm spare")
    a = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="ab-")
    base = os.path.join(tmp, "base")
    subprocess.run(["git", "worktree", "add", "-q", "--detach", base, rev], cwd=REPO, check=True)
    try:
        for so in glob.glob(os.path.join(REPO, "reft_ext", "*.so")):
            shutil.copy(so, os.path.join(base, "reft_ext"))
        rows: dict[str, list[dict]] = {rev: [], "this checkout": []}
        for r in range(a.repeats):
            for name, tree in ((rev, base), ("this checkout", REPO)):
                s = one_round(tree, a.scenario, a.mode)
                rows[name].append(s)
                print(f"  [round {r + 1}, {name}] " +
                      ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=REPO)
        shutil.rmtree(tmp, ignore_errors=True)
    keys = [k for k in rows[rev][0] if all(k in s for ss in rows.values() for s in ss)]
    print(f"\n{a.scenario}, {a.mode}: seconds from the fault, medians of {a.repeats} "
          f"interleaved rounds")
    print("| step | " + " | ".join(rows) + " | ratio |")
    print("|---|" + "---|" * (len(rows) + 1))
    for k in keys:
        m = [statistics.median(s[k] for s in rows[n]) for n in rows]
        ratio = f"{m[0] / m[1]:.2f}x" if m[1] else "-"
        print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in m) + f" | {ratio} |")


if __name__ == "__main__":
    main()
