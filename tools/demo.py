"""`make demo`: the default job from scratch with failures injected, and what REFT did.

    python tools/demo.py --run-dir runs/demo --nproc 4 --compare runs/default/train.log \
        -- <pretrain_llama.py flags> --inject-fault 1:150,2:250:KILL:node:1

Runs the job under torchrun (restarts allowed), writes its whole output to
<run-dir>/train.log, shows the iteration log lines and every fault and recovery as they
happen, then prints a digest: for each fault, which iteration came back from which tier,
how long REFT-load took and how long training stood still (from the fault to the next
committed snapshot, i.e. the next completed iteration); and the final loss and state
hashes side by side with the failure-free run's log (`make run`), bit for bit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = re.compile(r"\[FAULT\]|\[REFT\] (placement|recovery|recovered iteration \d+ on rank 0|"
                  r"summary)|"
                  r" iteration +\d+/|restart|Restart|\[HASH\]")
FAULT = re.compile(r"\[FAULT\] injecting (\w+) into rank (\d+) .*at iteration (\d+)(.*)")
RECOVERY = re.compile(r"\[REFT\] recovery: iteration (\d+) restored on \d+ ranks from (.+) "
                      r"in ([\d.]+) ms")
PERSISTENT = re.compile(r"\[REFT\] recovered iteration (\d+) from the persistent checkpoint")
SNAPSHOT = re.compile(r"\[REFT\] snapshot iteration (\d+):")
LOSS = re.compile(r" iteration +(\d+)/ *\d+ .*\| lm loss: ([0-9.E+-]+)")
HASH = re.compile(r"\[HASH\] rank (\d+) iteration (\d+) state ([0-9a-f]+)")


def run(args, trainer_args) -> list[tuple[float, str]]:
    from reft_ext.report.files import open_nofollow

    ckpt = os.path.join(args.run_dir, "checkpoints")
    # the digest times the first committed snapshot after each recovery: it needs every
    # snapshot's line, not one per --log-interval
    each = [] if "--reft-log-every-snapshot" in trainer_args else ["--reft-log-every-snapshot"]
    # torchrun with the reft rendezvous: its store on 127.0.0.1, no pickle from it
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *trainer_args, *each,
           "--save", ckpt, "--load", ckpt]
    print("$ python -m " + " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    lines = []
    with open_nofollow(os.path.join(args.run_dir, "train.log")) as log, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True) as proc:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            log.write(line)
            if SHOW.search(line):
                print(line, end="", flush=True)
    if proc.returncode:
        sys.exit(f"demo: the job failed (exit {proc.returncode}); see "
                 f"{os.path.join(args.run_dir, 'train.log')}")
    return lines


def digest(lines: list[tuple[float, str]]) -> list[str]:
    """One paragraph per fault: what was lost, what served it, the downtime."""
    out = []
    for i, (t_fault, line) in enumerate(lines):
        m = FAULT.search(line)
        if not m:
            continue
        sig, rank, it, rest = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        what = "lost node" if "node loss" in rest else "crash"
        out.append(f"- {what}: {sig} to rank {rank} in iteration {it}")
        recovered = None
        for t, later in lines[i + 1:]:
            r, p = RECOVERY.search(later), PERSISTENT.search(later)
            if r:
                recovered = int(r.group(1))
                out.append(f"  REFT-load: iteration {recovered} from {r.group(2)} in "
                           f"{float(r.group(3)):.0f} ms (lost work: "
                           f"{it - recovered - 1} completed iteration(s))")
                break
            if p:
                recovered = int(p.group(1))
                out.append(f"  loaded iteration {recovered} from the persistent checkpoint")
                break
        if recovered is None:
            out.append("  no recovery seen")
            continue
        for t, later in lines[i + 1:]:
            s = SNAPSHOT.search(later)
            if s and int(s.group(1)) > recovered:
                out.append(f"  training again {t - t_fault:.1f} s after the fault (next "
                           f"iteration committed: {s.group(1)})")
                break
    return out


def final(lines) -> tuple[tuple[int, str] | None, dict]:
    loss, hashes = None, {}
    for _, line in lines:
        m = LOSS.search(line)
        if m:
            loss = (int(m.group(1)), m.group(2))
        for h in HASH.finditer(line):  # ranks share the pipe: lines may run together
            hashes[int(h.group(1))] = h.group(3)
    return loss, hashes


def compare(lines, reference: str) -> list[str]:
    loss, hashes = final(lines)
    out = [f"- this run : iteration {loss[0]}, lm loss {loss[1]}" if loss else
           "- this run : no loss line"]
    if not os.path.isfile(reference):
        return out + [f"- no failure-free log at {reference}: run `make run` first to see "
                      f"both side by side"]
    with open(reference) as f:
        ref = [(0.0, line.rstrip("\n")) for line in f]
    ref_loss, ref_hashes = final(ref)
    out.append(f"- make run : iteration {ref_loss[0]}, lm loss {ref_loss[1]}" if ref_loss else
               f"- make run : no loss line in {reference}")
    same = bool(hashes) and hashes == ref_hashes
    out.append(f"- final loss {'identical' if loss == ref_loss else 'DIFFERENT'}; state of "
               f"{len(hashes)} ranks (sha256 of parameters and optimizer state) "
               f"{'bit-identical' if same else 'DIFFERENT'} to the failure-free run")
    return out


def compare_checkpoints(run_dir: str, reference: str) -> tuple[list[str], bool]:
    """The final persistent checkpoints of both runs, item by item through megatron-core
    (tools/compare_checkpoints.py: not REFT's list of tensors that the hashes cover)."""
    mine = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(reference):
        return [f"- no failure-free checkpoint at {reference}: run `make run` first"], True
    if REPO not in sys.path:  # run as a script: tools/ is sys.path[0], not the repository
        sys.path.insert(0, REPO)
    from tools.compare_checkpoints import compare_paths, table

    rows, counts = compare_paths(mine, reference)
    what = f"{counts['tensors']} tensors, {counts['items']} other items"
    if not rows:
        return [f"- final checkpoint identical to the failure-free run's, item by item "
                f"({what}; tools/compare_checkpoints.py)"], True
    return [f"- final checkpoint DIFFERS from the failure-free run's in {len(rows)} items:",
            table(rows)], False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/demo", help="wiped and rewritten")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--compare", default="runs/default/train.log",
                   help="log of the same job without faults (make run)")
    p.add_argument("--compare-checkpoint", default=None,
                   help="checkpoints of the same job without faults (default: the "
                        "'checkpoints' directory beside --compare)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER,
                   help="-- then pretrain_llama.py flags")
    args = p.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else \
        args.trainer_args
    shutil.rmtree(args.run_dir, ignore_errors=True)  # the demo starts from scratch
    os.makedirs(args.run_dir)
    lines = run(args, trainer_args)
    print("\n== REFT demo: what happened ==")
    print("\n".join(digest(lines) or ["- no fault fired"]))
    print("== final state vs the failure-free run ==")
    print("\n".join(compare(lines, args.compare)))
    ref_ckpt = args.compare_checkpoint or os.path.join(os.path.dirname(args.compare),
                                                       "checkpoints")
    report, same = compare_checkpoints(args.run_dir, ref_ckpt)
    print("\n".join(report))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
