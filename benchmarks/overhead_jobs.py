"""bench_overhead.py's A/B as a user runs it: the same job with and without REFT as
separate torchrun runs taking turns (none, reft, none, reft, ...), each timed by the
line Megatron prints every --log-interval ("elapsed time per iteration (ms)").

Per run: the median of its log windows after the first WARMUP iterations (start-up,
the first snapshots' slot creation and the allocator's warm-up are in those). Per round:
each variant's median against the plain run's of the same round (neighbours in time:
a host whose load drifts moves both). The figure is the median over the rounds, with a
distribution-free interval for it (:func:`median_interval`); a target reads as met, not
met, or not decided at this noise (:func:`verdict`).

Jobs (issue 57):
  default   `make run`'s job: its JOB_ARGS (read from the Makefile: the shipped corpus,
            tiny Llama, PP2 x DP2 ZeRO-1, 4 ranks, --reft-protect arc,aor), without
            --save/--load; "none" drops every --reft-* flag. Target reft/none <= 1.03.
  gpu-like  the GPU-like regime: 4 layers, hidden 1024 (~300 MiB of state per rank),
            8 tokens per micro-batch, PP2 on 2 ranks, --reft-protect none; HAS and the
            blocking end-of-iteration copy. Targets: has/none <= 1.03 while
            end-of-iteration/none >= 1.08 (the copy is a real share of the iteration).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_INTERVAL, WARMUP = 5, 10
CALIBRATION = re.compile(r"\[REFT\] calibration .*median iteration ([\d.]+) ms with, ([\d.]+) ms "
                         r"without")
ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
REFT_SNAP = ["--reft-snapshot-every", "1", "--reft-ranks-per-node", "1"]


def make_run_args(makefile: str = os.path.join(REPO, "Makefile")) -> list[str]:
    """JOB_ARGS of the Makefile (`make run`'s job), as a list."""
    text = open(makefile).read()
    m = re.search(r"^JOB_ARGS\s*=\s*((?:.*\\\n)*.*)$", text, re.M)
    if not m:
        raise RuntimeError(f"{makefile}: no JOB_ARGS")
    return shlex.split(m.group(1).replace("\\\n", " "))


def _drop(args: list[str], drop) -> list[str]:
    """``args`` without each flag ``drop(flag)`` is true of, and its value if it has one."""
    out, i = [], 0
    while i < len(args):
        if drop(args[i]):
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
            continue
        out.append(args[i])
        i += 1
    return out


def set_flag(args: list[str], flag: str, value: str | None) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (added if absent; removed if None)."""
    return _drop(args, lambda a: a == flag) + ([flag, value] if value is not None else [])


def without_reft(args: list[str]) -> list[str]:
    """Every --reft-* flag (and its value) dropped: the plain run."""
    return _drop(args, lambda a: a.startswith("--reft-"))


def jobs(iters: int) -> dict:
    """name -> (nproc, {variant: argv}); "none" first."""
    base = make_run_args()
    for flag, value in (("--train-iters", str(iters)), ("--log-interval", str(LOG_INTERVAL)),
                        ("--eval-interval", str(10 * iters)), ("--eval-iters", "0"),
                        ("--save-interval", None)):
        base = set_flag(base, flag, value)
    gpu = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
           "--num-query-groups", "16", "--ffn-hidden-size", "2816", "--seq-length", "8",
           "--max-position-embeddings", "8", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "2048", "--micro-batch-size", "1",
           "--global-batch-size", "2", "--pipeline-model-parallel-size", "2",
           "--lr", "1e-4", "--lr-warmup-iters", "2", "--train-iters", str(iters),
           "--log-interval", str(LOG_INTERVAL), "--eval-iters", "0",
           "--hidden-dropout", "0", "--attention-dropout", "0"]
    snap = REFT_SNAP + ["--reft-protect", "none"]
    return {
        "default": (4, {"none": without_reft(base), "reft": base}),
        "gpu-like": (2, {"none": gpu,
                         "has": gpu + snap + ["--reft-schedule", "has"],
                         "end-of-iteration": gpu + snap +
                         ["--reft-schedule", "end-of-iteration"]}),
    }


def run_job(nproc: int, argv: list[str], tag: str, timeout: float = 900) -> list[float]:
    """One torchrun of pretrain_llama.py; the log windows' ms per iteration after the
    warm-up. The job's own host memory is removed afterwards."""
    out = launch(nproc, argv, tag, timeout)
    ms = [float(ms) for it, ms in ELAPSED.findall(out) if int(it) > WARMUP]
    if not ms:
        sys.exit(f"{tag}: no 'elapsed time per iteration' line after iteration {WARMUP}:\n"
                 f"{out[-3000:]}")
    return ms


def launch(nproc: int, argv: list[str], tag: str, timeout: float = 900) -> str:
    """One torchrun of pretrain_llama.py (its output); a failed run exits with it."""
    job = f"ab{os.getpid()}{tag}"
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(REPO, "pretrain_llama.py"), *argv]
    if any(a.startswith("--reft-") for a in argv):
        cmd += ["--reft-job-id", job]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for a in [a for a in argv if a.startswith("ENV:")]:  # (--also x=ENV:NAME=VALUE)
        k, _, v = a[4:].partition("=")
        env[k] = v
        cmd.remove(a)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        shutil.rmtree(os.path.join("/dev/shm", f"reft-{job}"), ignore_errors=True)
    if proc.returncode:
        sys.exit(f"{tag} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return proc.stdout


def calibration_ratio(text: str) -> float:
    """with/without of the job's own ``[REFT] calibration`` line (reft_ext/report/
    calibration.py): its median iteration in the blocks with snapshots over that of the
    blocks without, in the same processes."""
    m = CALIBRATION.search(text)
    if not m:
        raise ValueError("no [REFT] calibration line with both medians in the job's output")
    return float(m.group(1)) / float(m.group(2))


def with_also(name: str, iters: int, also: dict | None) -> tuple[int, dict]:
    """(ranks, {variant: argv}) of job ``name`` with the ``also`` variants: the job's REFT
    run (``reft``, or ``has``) with their flags added."""
    nproc, variants = jobs(iters)[name]
    reft = variants.get("reft", variants.get("has"))
    return nproc, dict(variants, **{k: reft + v for k, v in (also or {}).items()})


def in_job(name: str, rounds: int, iters: int, bar=None, also: dict | None = None) -> dict:
    """The job's own A/B (``--reft-calibrate-iters``: snapshots skipped in every other
    block of 4 iterations, the same processes) for each REFT variant, ``rounds`` runs
    each, taking turns: {"paired": {variant: [with/without of each run]}}. Per run the blocks share the run's memory placement, so the level a
    process happens to run at (docs/has.md: the GPU-like job's optimizer step at one of
    two speeds per run) cancels; what runs in both kinds of block (AOR's replay, the
    instrumentation, the verdicts) is not in it."""
    nproc, variants = with_also(name, iters, also)
    variants.pop("none")
    # whole pairs of 4-iteration blocks that fit after the calibration's 5 of warm-up
    n = (iters - 8) // 8 * 8
    paired = {v: [] for v in variants}
    for r in range(rounds):
        for v, argv in variants.items():
            out = launch(nproc, argv + ["--reft-calibrate-iters", str(n)], f"{name}-{v}-{r}")
            try:
                paired[v].append(calibration_ratio(out))
            except ValueError as e:
                sys.exit(f"{name}-{v}-{r}: {e}:\n{out[-3000:]}")
            if bar is not None:
                bar.update()
    return {"paired": paired, "nproc": nproc}


def ab(name: str, rounds: int, iters: int, bar=None, also: dict | None = None) -> dict:
    """{variant: [median ms of each round's run]} and each round's ratio to the plain
    run's (the figure is their median, :func:`with_interval`). ``also``: more
    variants, name -> flags added to the job's REFT run (e.g. {"keep3": ["--reft-keep",
    "3"]})."""
    nproc, variants = with_also(name, iters, also)
    med = {v: [] for v in variants}
    for r in range(rounds):
        for v, argv in variants.items():
            med[v].append(statistics.median(run_job(nproc, argv, f"{name}-{v}-{r}")))
            if bar is not None:
                bar.update()
    paired = {v: [x / p for x, p in zip(med[v], med["none"])] for v in variants if v != "none"}
    return {"medians": med, "paired": paired, "nproc": nproc}


def median_interval(xs: list[float], level: float = 0.90) -> tuple[float, float, float]:
    """(low, high, confidence): a distribution-free interval for the median of the rounds'
    paired ratios (order statistics x_(k) and x_(n+1-k), the sign test's binomial): the
    narrowest whose confidence is at least ``level``, or the widest there is (all
    rounds) when so few rounds cannot reach it. It says how far the host's noise leaves
    the median from what more rounds would find."""
    xs, n = sorted(xs), len(xs)

    def covers(k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k))
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
    k = 1
    while k + 1 <= n - k and covers(k + 1) >= level:
        k += 1
    conf = covers(k)
    return xs[k - 1], xs[n - k], conf


def with_interval(xs: list[float]) -> str:
    """The median of ``xs`` with its interval, as the tables print it."""
    lo, hi, conf = median_interval(xs)
    return f"{statistics.median(xs):.3f} ({100 * conf:.0f}%: {lo:.3f}-{hi:.3f})"


def verdict(res: dict, variant: str, target: float, above: bool = False) -> str:
    """Met, not met, or not decided at this noise: the target against the interval."""
    lo, hi, conf = median_interval(res["paired"][variant])
    ok = (lo >= target) if above else (hi <= target)
    bad = (hi < target) if above else (lo > target)
    word = "met" if ok else "not met" if bad else "not decided at this noise (more rounds)"
    return (f"{statistics.median(res['paired'][variant]):.3f}, {100 * conf:.0f}% interval {lo:.3f}-{hi:.3f} "
            f"over {len(res['paired'][variant])} rounds: target {'>=' if above else '<='} "
            f"{target:.2f} {word}")


def table(name: str, res: dict, load: str) -> str:
    med = res["medians"]
    rounds = len(med["none"])
    lines = [f"\n## {name} (as a user runs it: {rounds} rounds, separate jobs taking turns, "
             f"{res['nproc']} ranks)", f"host load average (1 min): {load}",
             "| job | median ms/iter | ratio to none (paired, median over rounds; interval) | "
             "medians per round |", "|---|---|---|---|"]
    for v, xs in med.items():
        ratio = "-" if v == "none" else with_interval(res["paired"][v])
        lines.append(f"| {v} | {statistics.median(xs):.1f} | {ratio} | "
                     + " ".join(f"{x:.0f}" for x in xs) + " |")
    if len(med["none"]) > 1:
        lines.append(f"noise: the plain run's medians differ by up to "
                     f"{100 * (max(med['none']) / min(med['none']) - 1):.1f}% between rounds")
    return "\n".join(lines)


def in_job_table(name: str, res: dict, load: str) -> str:
    """:func:`in_job`'s figures: each variant's median with/without over the runs, its
    interval, every run's, and the issue's target read against it."""
    targets = {"reft": (1.03, False), "has": (1.03, False), "end-of-iteration": (1.08, True)}
    lines = [f"\n## {name}, the job's own A/B (--reft-calibrate-iters; "
             f"{len(next(iter(res['paired'].values())))} runs per variant, taking turns, "
             f"{res['nproc']} ranks)", f"host load average (1 min): {load}",
             "| variant | with/without snapshots (median over runs; interval) | per run |",
             "|---|---|---|"]
    for v, xs in res["paired"].items():
        lines.append(f"| {v} | {with_interval(xs)} | " + " ".join(f"{x:.3f}" for x in xs)
                     + " |")
    for v, (target, above) in targets.items():
        if v in res["paired"]:
            lines.append(f"{v} in the job (snapshots alone): "
                         f"{verdict(res, v, target, above)}")
    return "\n".join(lines)
