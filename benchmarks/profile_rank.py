"""pretrain_llama.py with chosen ranks under cProfile: where REFT's hooks spend a real
job's iteration (docs/has.md "Where the hooks' time goes").

    PROF_RANKS=0,2 python -m reft_ext.cluster.torchrun --standalone --nproc-per-node 4 \\
        benchmarks/profile_rank.py <pretrain_llama.py flags>
    python benchmarks/profile_rank.py --report reft-prof-rank0.out [--iters 80]

The first form writes reft-prof-rank<R>.out in the current directory (PROF_DIR to
change; not /tmp, where another user could have put a link of that name) for each rank of
PROF_RANKS; the second prints the per-iteration time of REFT's hook functions and of
what the hand-over (``_begin``) calls. cProfile inflates Python-heavy code (about 2x
here): compare entries with each other, not with the job's own figures.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKS = ("session.py:195(after_step)", "session.py:179(before_optimizer_step)",
         "snapshotter.py:274(_begin)", "snapshotter.py:348(_finish)",
         "transport.py:126(_on_step)")


def report(path: str, iters: int) -> None:
    st = pstats.Stats(path)
    rows = {f"{fn.rsplit('/', 1)[-1]}:{ln}({name})": (nc, ct, callees)
            for (fn, ln, name), (_, nc, _, ct, callees) in st.stats.items()}
    print(f"{path}: ms per iteration over {iters} iterations (cumulative, under cProfile)")
    for hook in HOOKS:
        nc, ct, _ = rows.get(hook, (0, 0.0, None))
        print(f"  {hook:45s} {1000 * ct / iters:7.2f} ms  ({nc} calls)")
    print("  _begin calls:")
    calls = [(ct, f"{fn.rsplit('/', 1)[-1]}:{ln}({name})")
             for (fn, ln, name), (_, _, _, ct, callers) in st.stats.items()
             for (cfn, cln, cname) in callers
             if cfn.endswith("snapshotter.py") and cname == "_begin" and fn != "~"]
    for ct, name in sorted(calls, reverse=True)[:8]:
        print(f"    {name:43s} {1000 * ct / iters:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", metavar="FILE",
                    help="print the per-iteration report of a profile this wrote")
    ap.add_argument("--iters", type=int, default=80,
                    help="the iterations the profiled job ran (the report's divisor)")
    args, rest = ap.parse_known_args()
    if args.report:
        report(args.report, args.iters)
        return
    rank = os.environ.get("RANK", "0")
    wanted = rank in os.environ.get("PROF_RANKS", "0").split(",")
    sys.path.insert(0, REPO)
    sys.argv = [os.path.join(REPO, "pretrain_llama.py"), *rest]
    prof = cProfile.Profile()
    if wanted:
        prof.enable()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if wanted:
            prof.disable()
            prof.dump_stats(os.path.join(os.environ.get("PROF_DIR", "."),
                                         f"reft-prof-rank{rank}.out"))


if __name__ == "__main__":
    main()
