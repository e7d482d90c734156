"""Running one job run of the chaos campaign (tools/chaos.py): torchrun of 4 ranks (the
project's launcher, reft_ext/cluster/torchrun.py: torchrun's agent with the signed ``reft``
rendezvous) with the run's ``--inject-fault`` flags, its output stamped with the wall
clock, the faults sent from outside while it runs, and nothing of it left alive
afterwards."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from reft_ext.report import events as ev
from reft_ext.report.files import open_nofollow
from reft_ext.store import paths
from tests.harness.run import LAYOUTS, TINY, parse
from tools.chaos_plan import Fault, RunPlan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- running a job ---------------------------------------------------------------------
ITER_LINE = re.compile(r" iteration +(\d+)/ *\d+ .*\| lm loss: ([0-9.E+-]+|nan|inf)")
FAULT_LINE = re.compile(r"\[FAULT\] (?:injecting (\w+) into|shared memory full for) "
                        r"rank (\d+) \(pid (\d+)\)")
# a straggler's (mode slow): once per process that slows, so once per attempt
SLOW_LINE = re.compile(r"\[FAULT\] slowing rank (\d+) \(pid (\d+)\)")


@dataclass
class JobOutput:
    returncode: int | None
    lines: list                 # (time, line)
    events: list
    result: object              # tests.harness.run.RunResult
    seconds: float
    timed_out: bool = False
    restarts: int = 0
    leaked: list = field(default_factory=list)  # processes a killed worker left behind


def _children(pid: int) -> list[int]:
    """Every child of ``pid`` (the children files of all its threads)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _environ(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    out = {}
    for it in items:
        k, _, v = it.partition(b"=")
        if k in (b"RANK", b"TORCHELASTIC_RESTART_COUNT"):
            out[k.decode()] = v.decode()
    return out


class Workers:
    """The job's worker processes (children of torchrun) by (attempt, rank), polled."""

    def __init__(self, agent: int):
        self.agent = agent
        self.known: dict[int, tuple[int, int]] = {}  # pid -> (attempt, rank)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def scan(self) -> None:
        for pid in _children(self.agent):
            if pid in self.known:
                continue
            env = _environ(pid)
            if "RANK" in env:
                with self.lock:
                    self.known[pid] = (int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                       int(env["RANK"]))

    def _loop(self) -> None:
        while not self.stop.wait(0.05):
            self.scan()

    def pid_of(self, attempt: int, rank: int) -> int | None:
        self.scan()
        with self.lock:
            for pid, (a, r) in self.known.items():
                if (a, r) == (attempt, rank) and _alive(pid):
                    return pid
        return None

    def attempts(self) -> int:
        with self.lock:
            return 1 + max((a for a, _ in self.known.values()), default=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _kill(pid: int | None, sig=signal.SIGKILL) -> None:
    if pid:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def base_args(layout: str, iters: int) -> list[str]:
    """The reference's flags: model, data and layout."""
    return TINY + ["--train-iters", str(iters)] + LAYOUTS[layout]


def fault_args(plan: RunPlan, opts, ckpt: str, job: str) -> list[str]:
    a = base_args(plan.layout, plan.train_iters) + [
        "--reft-snapshot-every", "1", "--reft-protect", plan.protect,
        "--reft-ranks-per-node", "1", "--reft-job-id", job,
        "--reft-hang-timeout", str(opts.hang_timeout),
        "--distributed-timeout-minutes", str(opts.collective_timeout_min)]
    if plan.save:
        a += ["--save", ckpt, "--load", ckpt, "--save-interval", str(opts.save_interval)]
    else:  # the final checkpoint only, for the verdict (chaos_verdicts.checkpoint_problems)
        a += ["--save", ckpt]
    if plan.async_save:
        a.append("--async-save")
    inject = plan.inject()
    if inject:
        a += ["--inject-fault", inject]
    return a


def run_job(args: list[str], *, max_restarts: int, timeout: float, log_path: str,
            externals=(), watcher_fault: str = "", job: str = "",
            on_fault=None) -> JobOutput:
    """One torchrun of 4 ranks, its output streamed (each line stamped with the wall
    clock) into ``log_path``; ``externals``: Faults sent from outside while it runs;
    ``on_fault()``: called as each fault fires (progress)."""
    # torchrun's flags and agent, the reft rendezvous registered first (no pickle from a
    # store without login); the agent runs in this process, its workers are its children
    cmd = [sys.executable, "-m", "reft_ext.cluster.torchrun", "--standalone",
           "--nproc-per-node=4", f"--max-restarts={max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.pop("REFT_NODE_GENERATION", None)
    events_path = log_path + ".events.jsonl"
    open_nofollow(events_path).close()  # never through a planted link
    env[ev.ENV] = events_path
    if watcher_fault:
        env["REFT_WATCHER_FAULT"] = watcher_fault
    else:
        env.pop("REFT_WATCHER_FAULT", None)
    t0 = time.time()
    lines: list = []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    workers = Workers(proc.pid)
    pending = sorted(externals, key=lambda f: f.attempt)
    iter_times: list[float] = []
    timers: list[threading.Timer] = []
    slowed: set[str] = set()  # ranks whose straggler fired (one progress step each)

    def send(f: Fault) -> None:
        _send_external(f, workers, job, lines)
        if f.fired and on_fault:
            on_fault()

    def read() -> None:
        with open_nofollow(log_path) as log:
            for line in proc.stdout:
                now = time.time()
                line = line.rstrip("\n")
                lines.append((now, line))
                log.write(f"{now:.3f} {line}\n")
                if on_fault and FAULT_LINE.search(line):
                    on_fault()
                slow = SLOW_LINE.search(line)
                if on_fault and slow and slow.group(1) not in slowed:
                    slowed.add(slow.group(1))
                    on_fault()
                m = ITER_LINE.search(line)
                if not m:
                    continue
                iter_times.append(now)
                it = int(m.group(1))
                for f in list(pending):
                    if f.iteration == it and workers.attempts() - 1 == f.attempt:
                        pending.remove(f)
                        t = threading.Timer(f.delay * _iteration_s(iter_times), send, (f,))
                        t.daemon = True
                        t.start()
                        timers.append(t)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    for t in timers:
        t.cancel()
    restarts = workers.attempts() - 1
    # torchrun has exited (or is killed now): whatever of the job is still alive (a
    # worker, a process a killed worker forked) is left behind; it may hold the output
    reader.join(0 if timed_out else 5)
    leaked = _kill_all(proc, workers, job)
    reader.join(30)
    workers.close()
    out = "\n".join(line for _, line in lines)
    result = parse(out, proc.wait(), events_path)
    return JobOutput(proc.returncode, lines, list(result.events), result,
                     time.time() - t0, timed_out, restarts, leaked)


def _iteration_s(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times[-4:], times[-3:])]
    return sorted(gaps)[len(gaps) // 2] if gaps else 0.5


def _watcher_pid(job: str, node: int) -> int | None:
    from reft_ext.cluster import status

    try:
        with open(status.watcher_pid_path("/dev/shm", job, node)) as f:
            pid = int(f.read().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"reft_ext.cluster.watcher" in cmd and job.encode() in cmd:
            return pid
    except (OSError, ValueError, IndexError):
        pass
    return None


def _send_external(f: Fault, workers: Workers, job: str, lines: list) -> None:
    pid = workers.pid_of(f.attempt, f.rank)
    if pid is None:
        f.where = f"rank {f.rank} of attempt {f.attempt} not running when due"
        return
    now = time.time()
    if f.kind == "ext-node":
        _kill(_watcher_pid(job, f.rank))
        shutil.rmtree(paths.node_dir("/dev/shm", job, f.rank), ignore_errors=True)
        _kill(pid)
        what = "SIGKILL + its node's /dev/shm directory and watcher removed"
    elif f.kind == "ext-stop":
        _kill(pid, signal.SIGSTOP)
        what = "SIGSTOP"
    else:
        _kill(pid)
        what = "SIGKILL"
    f.fired, f.t_fired, f.pid = True, now, pid
    f.where = f"[CHAOS] {what} sent to rank {f.rank} (pid {pid}) on attempt {f.attempt}"
    lines.append((now, f.where))


def _session_members(sids: set) -> list[int]:
    """Live processes whose session is one of ``sids`` (each worker leads its own:
    torchrun starts it with start_new_session, so what it forks stays in it)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[3]) in sids and rest[0] not in ("Z", "X"):
            out.append(int(d))
    return out


def _describe_pid(pid: int, workers: Workers) -> dict:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        sid, ppid = int(rest[3]), int(rest[1])
    except (OSError, IndexError):
        sid = ppid = None
    attempt, rank = workers.known.get(sid, (None, None))
    shm = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/dev/shm/"):
                shm.append(target)
    except OSError:
        pass
    return {"pid": pid, "ppid": ppid, "session_of_worker": sid, "rank": rank,
            "attempt": attempt, "shm_files": sorted(set(shm))[:4]}


def _kill_all(proc, workers: Workers, job: str) -> list[dict]:
    """Nothing a job run started may outlive it: torchrun, its workers and whatever
    they forked (each worker leads a session of its own), the node watchers of this job
    (by the pids they recorded). Returns the processes of the workers' sessions that
    were still alive although torchrun had ended (left behind by a killed worker)."""
    ended = proc.poll() is not None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    with workers.lock:
        sids = set(workers.known)
    left = _session_members(sids)
    leaked = [_describe_pid(pid, workers) for pid in left] if ended else []
    for pid in left:
        _kill(pid)
    if job:
        for node in range(4):
            _kill(_watcher_pid(job, node))
    return leaked


def cleanup_shm(job: str) -> None:
    for p in glob.glob(f"/dev/shm/reft-{glob.escape(job)}"):  # the job's parent
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass
