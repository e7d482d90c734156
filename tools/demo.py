"""`make demo`: the default job from scratch with failures injected, and what REFT did.

    python tools/demo.py --run-dir runs/demo --nproc 4 -- <pretrain_llama.py flags> \
        --inject-fault 1:150,2:250:KILL:node:1

Runs the job under torchrun (restarts allowed), writes its whole output to
<run-dir>/train.log, shows the iteration log lines and every fault and recovery as they
happen, then prints a digest: for each fault, which iteration came back from which tier,
how long REFT-load took and how long training stood still (from the fault to the next
committed snapshot, i.e. the next completed iteration); and the run side by side with a
failure-free run of the same flags, bit for bit: the state hashes, the logged loss of
the same iterations and the final checkpoints. That reference is the demo's own
(<reference-dir>-<checksum of the flags>, made once per flags and reused; `make run`'s
directory is never read), or the log given with --compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
LOSS = re.compile(r" iteration +(\d+)/ *\d+ .*\| lm loss: ([0-9.E+-]+) (\(of iterations "
                  r"(\d+)-\d+ only\) )?\|")
HASH = re.compile(r"\[HASH\] rank (\d+) iteration (\d+) state ([0-9a-f]+)")


def run(run_dir: str, nproc: int, max_restarts: int, trainer_args: list[str],
        show=SHOW) -> list[tuple[float, str]]:
    """The job under torchrun with --save/--load in ``run_dir``, its output in
    ``run_dir``/train.log; the lines ``show`` matches are printed as they come."""
    from reft_ext.report.files import open_nofollow

    ckpt = os.path.join(run_dir, "checkpoints")
    # the digest times the first committed snapshot after each recovery: it needs every
    # snapshot's line, not one per --log-interval
    each = [] if "--reft-log-every-snapshot" in trainer_args else ["--reft-log-every-snapshot"]
    # torchrun with the reft rendezvous: its store on 127.0.0.1, no pickle from it
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *trainer_args, *each,
           "--save", ckpt, "--load", ckpt]
    print("$ python -m " + " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    lines = []
    with open_nofollow(os.path.join(run_dir, "train.log")) as log, subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True) as proc:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            log.write(line)
            if show.search(line):
                print(line, end="", flush=True)
    if proc.returncode:
        sys.exit(f"demo: the job failed (exit {proc.returncode}); see "
                 f"{os.path.join(run_dir, 'train.log')}")
    return lines


def without_faults(trainer_args: list[str]) -> list[str]:
    """The same flags with every --inject-fault taken out (the failure-free run)."""
    out, skip = [], False
    for a in trainer_args:
        if skip:
            skip = False
        elif a == "--inject-fault":
            skip = True
        elif not a.startswith("--inject-fault="):
            out.append(a)
    return out


def reference_dir(base: str, nproc: int, trainer_args: list[str]) -> str:
    """``base``-<checksum of what makes the failure-free run>: one per set of flags."""
    key = json.dumps({"nproc": nproc, "args": without_faults(trainer_args)})
    return f"{base}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def ensure_reference(base: str, nproc: int, max_restarts: int,
                     trainer_args: list[str]) -> str:
    """The failure-free run of these flags: its log, made now unless a finished one is
    there (its marker is written last, so an interrupted one is made again)."""
    ref = reference_dir(base, nproc, trainer_args)
    done = os.path.join(ref, "finished.json")
    flags = without_faults(trainer_args)
    if os.path.isfile(done):
        print(f"== failure-free reference: {ref} (made before with the same flags) ==")
        return os.path.join(ref, "train.log")
    print(f"== failure-free reference: {ref} (once per set of flags) ==", flush=True)
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(ref)
    run(ref, nproc, max_restarts, flags, show=re.compile(r" iteration +\d+/"))
    with open(done, "w") as f:
        json.dump({"nproc": nproc, "args": flags}, f)
    return os.path.join(ref, "train.log")


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


def final(lines) -> tuple[dict, dict]:
    """(iteration -> (lm loss, first iteration averaged or None when the whole
    interval), rank -> final state hash). A line logged again after a recovery
    replaces the earlier one of its iteration."""
    losses, hashes = {}, {}
    for _, line in lines:
        m = LOSS.search(line)
        if m:
            losses[int(m.group(1))] = (m.group(2), int(m.group(4)) if m.group(4) else None)
        for h in HASH.finditer(line):  # ranks share the pipe: lines may run together
            hashes[int(h.group(1))] = h.group(3)
    return losses, hashes


def compare(lines, reference: str) -> tuple[list[str], bool]:
    """This run against the failure-free log ``reference``: (lines, identical). The loss
    of the iterations both logged over a whole interval (a line after a restart averages
    only the iterations since it, and says so), and the state hashes of every rank."""
    losses, hashes = final(lines)
    if not os.path.isfile(reference):
        return [f"- no failure-free log at {reference}"], False
    with open(reference) as f:
        ref_losses, ref_hashes = final([(0.0, line.rstrip("\n")) for line in f])
    label = f"failure-free run ({os.path.dirname(reference) or reference})"
    whole = sorted(i for i in losses if i in ref_losses and losses[i][1] is None
                   and ref_losses[i][1] is None)
    partial = sorted(i for i in losses if losses[i][1] is not None)
    differ = [i for i in whole if losses[i][0] != ref_losses[i][0]]
    out = []
    if whole:
        last = whole[-1]
        out.append(f"- lm loss of the {len(whole)} logged iterations both runs averaged "
                   f"over a whole interval: {'identical' if not differ else 'DIFFERENT'} "
                   f"(iteration {last}: this run {losses[last][0]}, {label} "
                   f"{ref_losses[last][0]})")
    else:
        out.append(f"- lm loss: no iteration logged over a whole interval by both this run "
                   f"and the {label}")
    if differ:
        out.append(f"  differs at iteration(s) {', '.join(map(str, differ))}")
    for i in partial:
        out.append(f"  not compared: iteration {i} (this run's line averages iterations "
                   f"{losses[i][1]}-{i} only, those since its restart)")
    same = bool(hashes) and hashes == ref_hashes
    out.append(f"- state of {len(hashes)} ranks (sha256 of parameters and optimizer state): "
               f"{'bit-identical' if same else 'DIFFERENT'} to the {label}")
    return out, same and bool(whole) and not differ


def compare_checkpoints(run_dir: str, reference: str) -> tuple[list[str], bool]:
    """The final persistent checkpoints of both runs, item by item through megatron-core
    (tools/compare_checkpoints.py: not REFT's list of tensors that the hashes cover)."""
    mine = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(reference):
        return [f"- no failure-free checkpoint at {reference}"], False
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
    p.add_argument("--reference-dir", default=None,
                   help="where the failure-free runs live, one per set of flags "
                        "(DIR-<checksum>; default: <run-dir>-reference)")
    p.add_argument("--compare", default=None,
                   help="instead: the log of a failure-free run of the same flags")
    p.add_argument("--compare-checkpoint", default=None,
                   help="its checkpoints (default: the 'checkpoints' directory beside "
                        "--compare)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER,
                   help="-- then pretrain_llama.py flags")
    args = p.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else \
        args.trainer_args
    reference = args.compare or ensure_reference(
        args.reference_dir or f"{args.run_dir.rstrip('/')}-reference", args.nproc,
        args.max_restarts, trainer_args)
    shutil.rmtree(args.run_dir, ignore_errors=True)  # the demo starts from scratch
    os.makedirs(args.run_dir)
    print(f"== the same job with faults: {args.run_dir} ==", flush=True)
    lines = run(args.run_dir, args.nproc, args.max_restarts, trainer_args)
    print("\n== REFT demo: what happened ==")
    print("\n".join(digest(lines) or ["- no fault fired"]))
    print("== this run vs the failure-free run ==")
    report, same = compare(lines, reference)
    print("\n".join(report))
    ref_ckpt = args.compare_checkpoint or os.path.join(os.path.dirname(reference),
                                                       "checkpoints")
    report, same_ckpt = compare_checkpoints(args.run_dir, ref_ckpt)
    print("\n".join(report))
    return 0 if same and same_ckpt else 1


if __name__ == "__main__":
    sys.exit(main())
