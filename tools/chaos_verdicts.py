"""The verdicts of the chaos campaign (tools/chaos.py): each job run compared with its
failure-free reference, bit for bit (every rank's final state hash, the [LOSSES], every
logged loss of every attempt), and each fault's outcome: when it fired, which tier
recovered it, whether its hang was found in time, which wrong state it left. The one
place where a job run is judged; docs/chaos.md explains the checks."""

from __future__ import annotations

import os

from tools.chaos_plan import RunPlan
from tools.chaos_run import FAULT_LINE, ITER_LINE, SLOW_LINE, JobOutput

STOP_SLACK_S = 5.0  # beyond the waiting limit (2 x timeout) before a hang counts as missed


# ---- what happened ---------------------------------------------------------------------
def tier_name(source: str) -> str:
    """The recovery event's source ('ARC replica + AOR replica') as a short tier."""
    short = {"own memory": "own", "ARC replica": "ARC", "AEC parity": "AEC",
             "AOR replica": "AOR"}
    return "+".join(short.get(p.strip(), p.strip()) for p in source.split("+"))


def iteration_losses(lines) -> list[tuple[float, int, str]]:
    out = []
    for t, line in lines:
        m = ITER_LINE.search(line)
        if m:
            out.append((t, int(m.group(1)), m.group(2)))
    return out


def checkpoint_problems(res, ref) -> tuple[list[str], str]:
    """The final persistent checkpoints of the run and its reference compared item by
    item (tools/compare_checkpoints.py: megatron-core's own state dict, not REFT's list of
    tensors the hashes cover), and the outcome in a word. Nothing to say when either is
    gone (--reanalyze)."""
    mine, theirs = getattr(res, "checkpoint", None), getattr(ref, "checkpoint", None)
    if not (mine and theirs and os.path.isdir(mine) and os.path.isdir(theirs)):
        return [], "not compared"
    from tools.compare_checkpoints import compare_paths

    try:
        rows, _ = compare_paths(mine, theirs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a verdict, not a crash
        return [f"the final checkpoint {mine} cannot be compared: {exc}"], "unreadable"
    if not rows:
        return [], "identical"
    names = ", ".join(name for name, _ in rows[:4]) + (" ..." if len(rows) > 4 else "")
    return [f"final checkpoint differs from the reference's in {len(rows)} items ({names})"
            ], "differs"


def straggler_outcome(f, fault_lines, events) -> None:
    """A straggler fired at its rank's first ``[FAULT] slowing`` line (one per attempt
    from ITER on); ``tier`` says whether straggler detection named the rank after that.
    Not named is no problem: a restart starts the detector's window afresh."""
    for t, line in fault_lines:
        m = SLOW_LINE.search(line)
        if m and int(m.group(1)) == f.rank:
            f.fired, f.t_fired, f.where, f.pid = True, t, line.strip(), int(m.group(2))
            break
    if not f.fired:
        return
    # the event is stamped by the rank, the line by the tool as it read it: a second's slack
    named = [e for e in events if e["event"] == "straggler" and e.get("rank") == f.rank
             and e["time"] >= f.t_fired - 1]
    if named:
        e = named[0]
        f.tier = f"named at iteration {e.get('iteration')}"
        f.where += f"; [REFT] straggler: rank {f.rank} named at iteration " \
                   f"{e.get('iteration')}, {e.get('ratio', 0):.2f}x the others' median"
    else:
        f.tier = "not named"


def analyze(plan: RunPlan, job: JobOutput, ref, ref_losses: dict, opts) -> dict:
    """Fill in each fault's outcome; returns the run's record."""
    faults = plan.faults
    events = job.events
    lines = job.lines
    # 1. when each internal fault fired: its [FAULT] line (rank, phase, attempt order)
    fault_lines = [(t, line) for t, line in lines if "[FAULT]" in line]
    used = set()
    for f in faults:
        if f.origin == "internal":
            for j, (t, line) in enumerate(fault_lines):
                m = FAULT_LINE.search(line)
                if j in used or not m or int(m.group(2)) != f.rank:
                    continue
                its = f.candidates or [f.iteration]
                if not any(f"at iteration {i}, phase {f.phase}" in line for i in its):
                    continue
                used.add(j)
                f.fired, f.t_fired, f.where, f.pid = True, t, line.strip(), int(m.group(3))
                break
        elif f.origin == "watcher":
            for e in events:
                if e["event"] == "fault" and e.get("phase") == "flush" and \
                        e.get("node") == f.rank and not f.fired:
                    # the watcher of that attempt: after the attempt's own fault fired
                    prev = [g for g in faults if g.attempt == f.attempt and g.stops]
                    if prev and prev[0].t_fired and e["time"] >= prev[0].t_fired - 1:
                        f.fired, f.t_fired, f.pid = True, e["time"], e.get("pid")
                        f.where = f"[FAULT] watcher of node {f.rank} killed mid-flush"
        elif f.origin == "straggler":
            straggler_outcome(f, fault_lines, events)
    fired = sorted((f for f in faults if f.fired and f.stops),
                   key=lambda f: f.t_fired)
    # 2. the recovery after each fault (the first after it fired)
    rec_events = [e for e in events if e["event"] in
                  ("recovery", "recovered_persistent", "recovery_impossible")]
    imported = [e for e in events if e["event"] == "imported_flushed"]
    losses = iteration_losses(lines)
    for n, f in enumerate(fired):
        t_next = fired[n + 1].t_fired if n + 1 < len(fired) else float("inf")
        rec = None
        after = [e for e in rec_events if e["time"] > f.t_fired]
        for e in after:
            if e["event"] == "recovery":
                rec = e
                f.tier, f.restored, f.recovery_ms = tier_name(e["source"]), \
                    e["iteration"], e["ms"]
                break
            if e["event"] == "recovered_persistent":
                rec = e
                f.tier, f.restored = "persistent", e["iteration"]
                break
            if e["event"] == "recovery_impossible" and e.get("rank") in (0, None):
                # a fresh start unless this attempt loads its persistent checkpoint next
                # (each attempt begins with its health check)
                nxt = [x for x in events if x["time"] > e["time"] and
                       x["event"] in ("health", "recovered_persistent", "recovery")]
                if nxt and nxt[0]["event"] == "recovered_persistent":
                    continue
                rec = e
                f.tier, f.restored = "fresh start", 0
                break
        if rec is None:
            f.tier = "none seen"
            continue
        if rec["time"] > t_next:
            f.tier += f" (after fault #{fired[n + 1].id})"
        if any(e["time"] > f.t_fired and e["time"] <= rec["time"] and
               e.get("iteration") == f.restored for e in imported) and f.tier != "persistent":
            f.tier = "flushed:" + f.tier
        back = [t for t, it, _ in losses if t > rec["time"]]
        if back:
            f.downtime_s = round(back[0] - f.t_fired, 2)
    # 3. hangs: every SIGSTOP must be ended by the watcher within its limit
    hangs = [e for e in events if e["event"] == "hang"]
    stops = [f for f in fired if f.kind in ("stop", "ext-stop")]
    claimed = set()
    limit = 2 * opts.hang_timeout + STOP_SLACK_S
    for f in stops:
        h = [e for e in hangs if e.get("rank") == f.rank and e["time"] >= f.t_fired]
        if h:
            claimed.add(id(h[0]))
            f.hang_s = round(h[0]["time"] - f.t_fired, 2)
            f.hang_verdict = "found" if f.hang_s <= limit else "found late"
            if f.hang_s > limit:
                f.problems.append(f"hang found {f.hang_s:.1f} s after the stop "
                                  f"(limit {limit:.0f} s)")
        else:
            f.hang_verdict = "missed"
            f.problems.append("the frozen rank was never named by the hang monitor")
    false_hangs = [e for e in hangs if id(e) not in claimed]
    # 4. health verdicts: the campaign never makes a node fail the health check
    false_health = [e for e in events if (e["event"] == "health" and not e.get("ok")) or
                    e["event"] in ("shrink", "health_stop")]
    # 5. bit for bit: every logged loss of every attempt, the final state and losses
    wrong_iters = [(t, it, v) for t, it, v in losses if ref_losses.get(it) not in (None, v)]
    # a wrong state shows at the first iteration after it was made and stays wrong until
    # a recovery replaces it: the first wrong loss after right ones blames the fault whose
    # recovery came last before it
    torn, wrong_state = [], False
    persistent_loads = [e["time"] for e in events if e["event"] == "recovered_persistent"]
    for t, it, v in losses:
        if ref_losses.get(it) in (None, v):
            wrong_state = False
            continue
        if wrong_state:
            continue
        wrong_state = True
        before = [f for f in fired if f.t_fired < t]
        if not before:
            continue
        culprit = before[-1]
        why = (f"iteration {it} logged loss {v}, the reference {ref_losses.get(it)}: wrong "
               f"state after the recovery of iteration {culprit.restored} ({culprit.tier})")
        if culprit.tier and culprit.tier != "persistent" and \
                any(x < culprit.t_fired for x in persistent_loads):
            why += "; a persistent checkpoint was loaded earlier in this job run"
        culprit.problems.append(why)
        if id(culprit) not in {id(x) for x in torn}:
            torn.append(culprit)
    res = job.result
    problems = []
    if job.timed_out:
        problems.append(f"the job run did not end within {opts.run_timeout} s (hang)")
    elif job.returncode != 0:
        problems.append(f"torchrun exited {job.returncode}")
    if res.hashes != ref.hashes:
        diff = sorted(r for r in set(ref.hashes) | set(res.hashes)
                      if res.hashes.get(r) != ref.hashes.get(r))
        problems.append(f"final state differs from the reference on ranks {diff}"
                        if res.hashes else "no final state hashes")
    bad_losses = sorted(i for i in res.losses if res.losses[i] != ref.losses.get(i))
    if bad_losses:
        problems.append(f"[LOSSES] differ at iterations {bad_losses}")
    for rank, losses in sorted(res.losses_by_rank.items()):  # every rank that logs
        want = ref.losses_by_rank.get(rank, {})
        bad = sorted(i for i in losses if losses[i] != want.get(i))
        if bad:
            problems.append(f"[LOSSES] of rank {rank} differ at iterations {bad}")
    ckpt_problems, checkpoint = checkpoint_problems(res, ref)
    problems += ckpt_problems
    if res.losses and max(res.losses) != plan.train_iters:
        problems.append(f"losses end at {max(res.losses)}, not {plan.train_iters}")
    # a fault of a terminal phase may or may not stop the job (the async save's writer:
    # megatron-core's finalize raises on every rank)
    expected_restarts = len(fired)  # the faults that stop a process
    if job.restarts > expected_restarts and not job.timed_out:
        problems.append(f"{job.restarts} restarts for {expected_restarts} faults that stop "
                        f"a process")
    exact = not problems and not wrong_iters
    for f in faults:
        if not f.fired:
            f.verdict = "NOT FIRED"
            f.problems.append(f.where or "its moment never came")
        elif f.problems:
            f.verdict = "NOT EXACT"
        elif exact:
            f.verdict = "exact"
        else:
            f.verdict = "NOT EXACT (run)"
    return {"run": plan.index, "layout": plan.name, "train_iters": plan.train_iters,
            "inject_fault": plan.inject(), "watcher_fault": plan.watcher_env(),
            "async_save": plan.async_save, "returncode": job.returncode,
            "seconds": round(job.seconds, 1), "restarts": job.restarts,
            "timed_out": job.timed_out, "exact": exact, "problems": problems,
            "checkpoint": checkpoint,
            "false_hangs": [{k: e.get(k) for k in ("rank", "iteration", "silent_s",
                                                     "state", "process")}
                            for e in false_hangs],
            "false_health": [{k: e.get(k) for k in ("event", "nodes", "reason", "failures")}
                             for e in false_health],
            "torn": [f.id for f in torn], "leaked": job.leaked}
