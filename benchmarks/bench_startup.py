"""What every torchrun launch pays before training: the trainer's imports, with
megatron-core's jit_fuser deferred (the default, megatron/training/lazy_jit.py) and as
megatron-core does it (torch.compile at import, which pulls in torch._dynamo and
torch._inductor), interleaved in one run.

    python benchmarks/bench_startup.py [--repeats 7]

Each sample is a fresh `python -c` that imports what pretrain_llama.py imports before
the first iteration (megatron.training.training, reft_integration, checkpointing, data); the
eager variant imports megatron.core first, before megatron.training can install the
deferral. CPU seconds (user + sys of the child) are the figure that matters on a loaded
machine (4 ranks importing on 2 cores), wall seconds are printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from reft_ext.report.progress import Progress  # noqa: E402

IMPORTS = ("import megatron.training.training, megatron.training.reft_integration, "
           "megatron.training.checkpointing, megatron.training.data")
CODE = {
    "deferred (default)": IMPORTS,
    "eager (megatron-core as is)": "import megatron.core; " + IMPORTS,
}
PROBE = ("; import sys, resource; r = resource.getrusage(resource.RUSAGE_SELF); "
         "print(r.ru_utime + r.ru_stime, 'torch._inductor' in sys.modules)")


def sample(code: str) -> tuple[float, float, bool]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code + PROBE], cwd=REPO,
                         capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    cpu, inductor = out.stdout.split()
    return float(cpu), wall, inductor == "True"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    res = {k: [] for k in CODE}
    sample(IMPORTS)  # warm the page cache and .pyc files
    with Progress(a.repeats * len(CODE), desc="bench_startup", unit="import") as bar:
        for _ in range(a.repeats):
            for name, code in CODE.items():  # interleaved
                res[name].append(sample(code))
                bar.update()
    print(f"trainer imports per rank, {a.repeats} interleaved samples, medians")
    print(f"{'megatron-core jit_fuser':<30}{'CPU s':>8}{'wall s':>8}  torch._inductor imported")
    for name, rows in res.items():
        print(f"{name:<30}{statistics.median(r[0] for r in rows):>8.2f}"
              f"{statistics.median(r[1] for r in rows):>8.2f}  {rows[0][2]}")
    d = statistics.median(r[0] for r in res["deferred (default)"])
    e = statistics.median(r[0] for r in res["eager (megatron-core as is)"])
    print(f"saved per rank: {e - d:.2f} CPU s ({100 * (e - d) / e:.0f}%); a 4-rank launch "
          f"on 2 cores: ~{2 * (e - d):.1f} s of wall time")


if __name__ == "__main__":
    main()
