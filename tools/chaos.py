"""Chaos campaign: random faults at random moments, each recovery checked bit for bit.

    python tools/chaos.py --seed 1 --faults 30 --layouts pp2dp2:arc dp4:aec \\
        --out /tmp/chaos/results.json

For each layout (``LAYOUT:PROTECT``, LAYOUT a name of tests/harness/run.py's LAYOUTS) the
job runs once failure-free (the reference: the same model, data and layout without REFT
and without faults), then in several job runs of ``--faults-per-run`` faults each. Every
fault of a job run lands on its own torchrun attempt (attempt 0 meets the first, the
restarted attempt 1 the second, ...; ``--max-restarts`` is the number of faults), so each
restart meets the next fault:

* inside the processes (``--inject-fault RANK:ITER:SIGNAL:MODE:ATTEMPT@PHASE``,
  megatron/training/fault_injection.py): a random rank, phase (the moments of an
  iteration, of a persistent save, of the start-up health check, of REFT-load, ...),
  iteration and kind: SIGKILL, SIGTERM, SIGSTOP (a hang that REFT's watcher must end
  within ``--hang-timeout``), a lost node (the rank and its failure domain's shared
  memory), a corrupted snapshot (flipped byte in the own slice or in the replica, a
  rewritten manifest or commit pointer; then SIGKILL), a full /dev/shm; and, beside a
  kill, a node watcher killed halfway through its flush (``REFT_WATCHER_FAULT``);
* from outside, at a random wall-clock moment (a random fraction of an iteration after
  a random iteration's log line): SIGKILL or SIGSTOP of a random worker found in
  torchrun's process tree, or a lost node (its watcher and worker SIGKILLed, its
  /dev/shm directory removed).

Each job run is then compared with the reference: every rank's final state hash
([HASH]), every later loss ([LOSSES], bit for bit) and every iteration's logged loss of
every attempt (a wrong state loaded by a recovery shows at the next iteration). The
events file (``REFT_EVENTS_FILE``, reft_ext/report/events.py) says which tier recovered
each fault (own memory, ARC replica, AEC parity, AOR replica, the flushed tier, the
persistent checkpoint, or a fresh start), how long REFT-load took and whether a hang
was found and by whom. One line per fault, a verdict, and a summary table at the end:
faults by phase and kind, recoveries by tier, bit-exact %, hangs past the hang timeout,
torn (wrong) loads, false hang / health verdicts. Exit code 1 on any outcome that is not
exact (a run that failed or differs, a hang past the timeout, a fault that never fired,
a false verdict). ``--out`` writes everything as JSON. docs/chaos.md explains the checks.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # python tools/chaos.py: the repository's packages
    sys.path.insert(0, REPO)

from megatron.training import fault_injection as fi  # noqa: E402 (no torch at import)
from reft_ext.report import events as ev  # noqa: E402
from reft_ext.report.progress import Progress  # noqa: E402
from reft_ext.store import paths  # noqa: E402
from tests.harness.run import LAYOUTS, TINY, parse  # noqa: E402

# the campaign of `make chaos` (docs/chaos.md)
DEFAULT_LAYOUTS = ["tp2dp2:arc", "pp2dp2-zero1:arc,aor", "dp4:aec", "dp4-zero1:aec,aor",
                   "pp2-interleaved:arc"]

# ---- what a fault can be -------------------------------------------------------------
INTERNAL_KINDS = ("kill", "term", "stop", "node", "corrupt", "corrupt-replica",
                  "corrupt-manifest", "corrupt-committed", "shm-full")
EXTERNAL_KINDS = ("ext-kill", "ext-stop", "ext-node")
WATCHER_KINDS = ("watcher-kill",)  # the flush phase: beside a kill on the same attempt
KINDS = (*INTERNAL_KINDS, *EXTERNAL_KINDS, *WATCHER_KINDS)
# how often each kind is drawn, relative (the corrupt modes share one weight of 2)
KIND_WEIGHT = {"kill": 3, "term": 1, "stop": 1.5, "node": 2, "corrupt": 0.5,
               "corrupt-replica": 0.5, "corrupt-manifest": 0.5, "corrupt-committed": 0.5,
               "shm-full": 0.5, "ext-kill": 1, "ext-stop": 1, "ext-node": 1}
SIGNAL_OF = {"kill": "KILL", "term": "TERM", "stop": "STOP", "shm-full": "KILL"}
WALL_CLOCK = "wall-clock"  # the phase of a fault sent from outside

# phases whose fault needs a restart before it (REFT-load, the health check) and whose
# ITER is not a training iteration: the iteration restored / resumed from
RESTART_PHASES = ("health", "load-read", "load-exchange", "load-rebuild")
# where a SIGSTOP is judged by the hang monitor: the heartbeat is armed and beating
# (start-up, REFT-load, the first iteration of an attempt and persistent saves are
# PAUSED by design, reft_ext/cluster/heartbeat.py: a hang there ends at the collective
# timeout, so the campaign does not freeze a rank there)
ARMED_PHASES = ("forward", "backward", "send", "recv", "step", "has-copy",
                "snapshot-write", "commit", "aor")
SAVE_PHASES = ("save", "save-tracker", "save-done", "save-async")
# a fault there kills a process the job does not restart for (the async save's forked
# writer): the run's last fault, so that no later attempt waits for a restart
TERMINAL_PHASES = ("save-async",)
# faults after which every node's watcher flushes (a worker of the attempt died)
KILLING = ("kill", "term", "stop", "node", "corrupt", "corrupt-replica", "corrupt-manifest",
           "corrupt-committed", "ext-kill", "ext-stop", "ext-node")

STOP_SLACK_S = 5.0  # beyond the waiting limit (2 x timeout) before a hang counts as missed


def available_phases() -> tuple[str, ...]:
    """The phases megatron/training/fault_injection.py knows (``step`` before phases
    existed)."""
    return tuple(getattr(fi, "PHASES", ("step",)))


def layout_of(spec: str) -> tuple[str, str, bool]:
    """'pp2dp2-zero1:arc,aor' -> ('pp2dp2-zero1', 'arc,aor', True); a third field
    ``nosave`` runs that layout without persistent checkpoints (no --save: no save
    phases, no flushed tier)."""
    name, _, rest = spec.partition(":")
    protect, _, opt = rest.partition(":")
    if name not in LAYOUTS:
        raise SystemExit(f"chaos: unknown layout {name!r} (tests/harness/run.py LAYOUTS: "
                         f"{', '.join(LAYOUTS)})")
    if opt not in ("", "nosave"):
        raise SystemExit(f"chaos: {spec!r}: the third field may only be 'nosave'")
    return name, protect or "arc", opt != "nosave"


def pipelined(layout: str) -> bool:
    return "--pipeline-model-parallel-size" in LAYOUTS[layout]


# ---- the plan --------------------------------------------------------------------------
@dataclass
class Fault:
    id: int
    run: int
    layout: str
    attempt: int
    kind: str
    phase: str
    rank: int
    iteration: int            # internal: ITER; external: the iteration line it follows
    candidates: list = field(default_factory=list)  # ITERs of a restart phase (one fires)
    delay: float = 0.0        # external: the fraction of an iteration after the line
    # ---- what happened ----
    fired: bool = False
    t_fired: float | None = None
    where: str = ""           # the [FAULT] line, or what the tool did
    pid: int | None = None
    tier: str = ""
    restored: int | None = None
    recovery_ms: float | None = None
    downtime_s: float | None = None
    hang_s: float | None = None      # SIGSTOP: the stop to the watcher's kill
    hang_verdict: str = ""
    problems: list = field(default_factory=list)
    verdict: str = ""

    @property
    def origin(self) -> str:
        return "external" if self.kind in EXTERNAL_KINDS else \
            "watcher" if self.kind in WATCHER_KINDS else "internal"

    def specs(self) -> list[str]:
        """Its --inject-fault specs (several ITERs for a restart phase: the one that
        matches fires, the process dies, the others never can)."""
        if self.origin != "internal":
            return []
        mode = {"node": "node", "shm-full": "shm-full"}.get(self.kind, "")
        if self.kind.startswith("corrupt"):
            mode = self.kind
        sig = SIGNAL_OF.get(self.kind, "KILL")
        at = "" if self.phase == "step" else f"@{self.phase}"
        its = self.candidates or [self.iteration]
        return [f"{self.rank}:{it}:{sig}:{mode}:{self.attempt}{at}" for it in its]

    def describe(self) -> str:
        what = {"kill": "SIGKILL", "term": "SIGTERM", "stop": "SIGSTOP (hang)",
                "node": "node loss", "shm-full": "full /dev/shm", "ext-kill":
                "SIGKILL from outside", "ext-stop": "SIGSTOP from outside (hang)",
                "ext-node": "node loss from outside", "watcher-kill":
                "watcher killed mid-flush"}.get(self.kind, self.kind + " + SIGKILL")
        if self.origin == "external":
            when = f"{self.delay:.2f} of an iteration after iteration {self.iteration}"
        elif self.origin == "watcher":
            when = "halfway through its flush"
        elif self.candidates:
            when = f"@{self.phase} restoring/resuming one of {self.candidates[0]}.." \
                   f"{self.candidates[-1]}"
        else:
            when = f"@{self.phase} iteration {self.iteration}"
        who = f"node {self.rank}" if self.origin == "watcher" else f"rank {self.rank}"
        return f"{what} to {who} {when}"


@dataclass
class RunPlan:
    index: int
    layout: str
    protect: str
    train_iters: int
    faults: list
    async_save: bool = False
    save: bool = True  # persistent checkpoints (--save/--load, --save-interval)

    @property
    def name(self) -> str:
        return f"{self.layout}:{self.protect}{'' if self.save else ':nosave'}"

    def inject(self) -> str:
        return ",".join(s for f in self.faults for s in f.specs())

    def watcher_env(self) -> str:
        return ",".join(f"flush:{f.rank}:{f.attempt}" for f in self.faults
                        if f.origin == "watcher")

    def restarts(self) -> int:
        return sum(1 for f in self.faults if f.origin != "watcher")


class Planner:
    """Draws the faults of one job run, attempt after attempt, so that each one can fire:
    its iteration lies past every iteration an earlier attempt could have restored."""

    def __init__(self, rng: random.Random, opts):
        self.rng, self.o, self.save = rng, opts, True
        self.phases = [p for p in opts.phases if p != "flush"]

    def phases_for(self, kind: str, layout: str, protect: str, k: int,
                   save: bool = True) -> list:
        o, ps = self.o, []
        for p in self.phases:
            if p in SAVE_PHASES and not save:
                continue
            if p in ("send", "recv") and not pipelined(layout):
                continue
            if p == "aor" and "aor" not in protect:
                continue
            if p in ("load-read", "load-exchange", "load-rebuild") and k == 0:
                continue  # nothing to load on a fresh start
            if p == "save-async" and not o.async_save_ok:
                continue
            if kind == "stop" and p not in ARMED_PHASES:
                continue
            if (kind == "node" or kind.startswith("corrupt")) and p == "health":
                continue  # before REFT's session exists: no damage to do
            if kind == "shm-full" and (p != "health" or k > 0):
                # the start-up health check comes right before REFT's session creates
                # its snapshot slots (the reservations); a restart attaches to them
                continue
            ps.append(p)
        return ps

    def plan(self, index: int, layout: str, protect: str, n: int, first_id: int,
             save: bool = True) -> RunPlan:
        o, rng = self.o, self.rng
        iters, S = o.run_iters, o.save_interval
        faults: list[Fault] = []
        reach = 0  # the newest iteration any attempt so far may have restored or resumed
        self.floor = 0  # the oldest iteration the last fault may leave to restore
        internal = [k for k in o.kinds if k in INTERNAL_KINDS]
        external = [k for k in o.kinds if k in EXTERNAL_KINDS]
        for k in range(n):
            remaining = n - k
            step = max(1, (iters - 2 - reach) // remaining)
            for _ in range(5000):
                if external and (not internal or rng.random() < o.external_share):
                    kind = rng.choices(external, [KIND_WEIGHT[x] for x in external])[0]
                    ps = [WALL_CLOCK]
                else:
                    kind = rng.choices(internal, [KIND_WEIGHT[x] for x in internal])[0]
                    ps = self.phases_for(kind, layout, protect, k, save)
                if not ps:
                    continue
                f = Fault(first_id + len(faults), index,
                          f"{layout}:{protect}{'' if save else ':nosave'}", k, kind,
                          rng.choice(ps), rng.randrange(4), 0)
                self.save, self.new_floor = save, self.floor
                new_reach = self.place(f, reach, step, iters, S)
                if new_reach is None:
                    continue
                if f.phase in TERMINAL_PHASES and remaining > 1:
                    continue  # no restart follows: the run's last fault
                break
            else:
                raise SystemExit(f"chaos: no fault of the kinds {o.kinds} fits attempt {k} "
                                 f"of a {iters}-iteration run on {layout}")
            reach, self.floor = new_reach, self.new_floor
            faults.append(f)
            if "flush" in o.phases and save and kind in KILLING and f.phase not in RESTART_PHASES \
                    and f.iteration >= 2 and rng.random() < o.flush_share:
                # the watchers of this attempt (started once training began) flush the
                # committed snapshots after its kill: one dies midway (not the lost
                # node's: it has nothing left to flush)
                nodes = [n for n in range(4) if not (kind in ("node", "ext-node") and
                                                     n == f.rank)]
                faults.append(Fault(first_id + len(faults), index, f.layout, k,
                                    "watcher-kill", "flush", rng.choice(nodes), f.iteration))
        async_save = any(f.phase == "save-async" for f in faults)
        return RunPlan(index, layout, protect, iters, faults, async_save, save)

    def place(self, f: Fault, reach: int, step: int, iters: int, S: int) -> int | None:
        """Choose the fault's iteration (past ``reach``: it must be reached on its
        attempt); returns the new reach, None when it does not fit the run."""
        rng = self.rng
        lo = reach + (2 if f.kind in ("stop", "ext-stop") else 1)
        hi = min(lo + step - 1, iters - 2)
        if f.phase in RESTART_PHASES:
            # the iteration restored (load) or resumed from (health): decided by the
            # faults before; every one it may be is a candidate (one fires, the process
            # dies, the others can never fire)
            if f.phase != "health" and (self.floor < 1 or
                                        (self.save and (reach // S) * S > self.floor)):
                # REFT-load runs only when host memory serves the restart: not on a
                # fresh start, not when a persistent checkpoint newer than the oldest
                # iteration the earlier fault may have left (self.floor) serves it
                return None
            low = max(0 if f.phase == "health" else 1, reach - S - 2)
            if reach < low:
                return None  # nothing to load yet: the attempt starts fresh
            f.candidates = list(range(low, reach + 1))
            if f.phase == "health" and 0 not in f.candidates:
                f.candidates.insert(0, 0)
            f.iteration = reach
            return reach
        if lo > hi:
            return None
        it = rng.randint(lo, hi)
        if f.phase == WALL_CLOCK:
            if f.kind == "ext-stop":  # not next to a save (PAUSED: not judged)
                while it % S == 0 or (it + 1) % S == 0:
                    it += 1
                if it > iters - 2:
                    return None
            f.iteration, f.delay = it, round(rng.random(), 3)
            self.new_floor = it - 1  # iteration it-1 was committed before line it
            return it + 2  # lands in iteration it+1 (or it+2 on a slow host)
        if f.phase in SAVE_PHASES:  # a save follows iterations S, 2S, ...
            it = ((it + S - 1) // S) * S
            if it > iters - 1:
                return None
        f.iteration = it
        self.new_floor = it - 2  # a kill in ITER's passes: ITER-1 not committed yet
        return it


def plan_campaign(opts) -> list[RunPlan]:
    rng = random.Random(opts.seed)
    planner = Planner(rng, opts)
    runs, fid, left = [], 0, opts.faults
    layouts = [layout_of(s) for s in opts.layouts]
    i = 0
    while left > 0:
        layout, protect, save = layouts[i % len(layouts)]
        n = min(opts.faults_per_run, left)
        p = planner.plan(i, layout, protect, n, fid, save)
        runs.append(p)
        fid += len(p.faults)
        left -= sum(1 for f in p.faults if f.origin != "watcher")
        i += 1
    return runs


# ---- running a job ---------------------------------------------------------------------
ITER_LINE = re.compile(r" iteration +(\d+)/ *\d+ .*\| lm loss: ([0-9.E+-]+|nan|inf)")
FAULT_LINE = re.compile(r"\[FAULT\] (?:injecting (\w+) into|shared memory full for) "
                        r"rank (\d+) \(pid (\d+)\)")


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=4", f"--max-restarts={max_restarts}",
           os.path.join(REPO, "pretrain_llama.py"), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.pop("REFT_NODE_GENERATION", None)
    events_path = log_path + ".events.jsonl"
    open(events_path, "w").close()
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

    def send(f: Fault) -> None:
        _send_external(f, workers, job, lines)
        if f.fired and on_fault:
            on_fault()

    def read() -> None:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                now = time.time()
                line = line.rstrip("\n")
                lines.append((now, line))
                log.write(f"{now:.3f} {line}\n")
                if on_fault and FAULT_LINE.search(line):
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
    for p in glob.glob(f"/dev/shm/reft-{glob.escape(job)}-*"):
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass


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
                    prev = [g for g in faults if g.attempt == f.attempt and g is not f]
                    if prev and prev[0].t_fired and e["time"] >= prev[0].t_fired - 1:
                        f.fired, f.t_fired, f.pid = True, e["time"], e.get("pid")
                        f.where = f"[FAULT] watcher of node {f.rank} killed mid-flush"
    fired = sorted((f for f in faults if f.fired and f.origin != "watcher"),
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
    if res.losses and max(res.losses) != plan.train_iters:
        problems.append(f"losses end at {max(res.losses)}, not {plan.train_iters}")
    # a fault of a terminal phase may or may not stop the job (the async save's writer:
    # megatron-core's finalize raises on every rank)
    expected_restarts = sum(1 for f in fired if f.origin != "watcher")
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
            "false_hangs": [{k: e.get(k) for k in ("rank", "iteration", "silent_s",
                                                     "state", "process")}
                            for e in false_hangs],
            "false_health": [{k: e.get(k) for k in ("event", "nodes", "reason", "failures")}
                             for e in false_health],
            "torn": [f.id for f in torn], "leaked": job.leaked}


# ---- the report ------------------------------------------------------------------------
def fault_line(f: Fault) -> str:
    out = [f"#{f.id:<3d} run {f.run:<2d} {f.layout:<22s} att {f.attempt} "
           f"{f.describe()}"]
    if f.fired and f.origin == "watcher":
        out.append("-> the flush it cut short must never be imported")
    elif f.fired:
        rec = f.tier or "?"
        if f.restored is not None:
            rec = f"iteration {f.restored} from {f.tier}"
        if f.recovery_ms is not None:
            rec += f" in {f.recovery_ms:.0f} ms"
        out.append(f"-> {rec}")
        if f.hang_s is not None:
            out.append(f"hang found after {f.hang_s:.1f} s")
        if f.downtime_s is not None:
            out.append(f"downtime {f.downtime_s:.1f} s")
    out.append(f"[{f.verdict}]")
    if f.problems:
        out.append("; ".join(f.problems))
    return " | ".join(out)


def summary(runs: list[dict], faults: list[Fault], opts) -> dict:
    by_pk = collections.Counter((f.phase, f.kind) for f in faults)
    exact_pk = collections.Counter((f.phase, f.kind) for f in faults if f.verdict == "exact")
    tiers = collections.Counter(f.tier.split(" (after")[0] for f in faults
                                if f.fired and f.origin != "watcher")
    fired = [f for f in faults if f.fired]
    return {
        "faults": len(faults), "fired": len(fired),
        "exact": sum(1 for f in faults if f.verdict == "exact"),
        "bit_exact_pct": round(100.0 * sum(1 for f in faults if f.verdict == "exact") /
                               max(len(fired), 1), 1),
        "runs": len(runs), "runs_exact": sum(1 for r in runs if r["exact"]),
        "by_phase_kind": {f"{p}/{k}": [by_pk[(p, k)], exact_pk[(p, k)]]
                          for p, k in sorted(by_pk)},
        "by_tier": dict(tiers.most_common()),
        "hangs": sum(1 for f in faults if f.kind in ("stop", "ext-stop") and f.fired),
        "hangs_past_timeout": sum(1 for f in faults if f.hang_verdict in ("missed",
                                                                          "found late")),
        "torn_loads": sum(len(r["torn"]) for r in runs),
        "false_hang_verdicts": sum(len(r["false_hangs"]) for r in runs),
        "false_health_verdicts": sum(len(r["false_health"]) for r in runs),
        "not_fired": sum(1 for f in faults if not f.fired),
        "leaked_processes": sum(len(r.get("leaked", ())) for r in runs),
        "downtime_s_median": _median([f.downtime_s for f in faults if f.downtime_s]),
        "hang_found_s_median": _median([f.hang_s for f in faults if f.hang_s]),
    }


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def table(s: dict, faults: list[Fault]) -> str:
    """The campaign's table (markdown: docs/chaos.md shows it as printed)."""
    kinds = [k for k in KINDS if any(f.kind == k for f in faults)]
    phases = sorted({f.phase for f in faults},
                    key=lambda p: (available_phases() + (WALL_CLOCK,)).index(p)
                    if p in available_phases() + (WALL_CLOCK,) else 99)
    out = ["faults by phase and kind (exact/total):", "",
           "| phase | " + " | ".join(kinds) + " | all |",
           "|---|" + "---|" * (len(kinds) + 1)]
    for p in phases:
        cells = []
        for k in kinds:
            tot, ok = s["by_phase_kind"].get(f"{p}/{k}", [0, 0])
            cells.append(f"{ok}/{tot}" if tot else "")
        tot = sum(s["by_phase_kind"].get(f"{p}/{k}", [0, 0])[0] for k in kinds)
        ok = sum(s["by_phase_kind"].get(f"{p}/{k}", [0, 0])[1] for k in kinds)
        out.append(f"| {p} | " + " | ".join(cells) + f" | {ok}/{tot} |")
    out += ["", "recoveries by tier:", "", "| tier | faults |", "|---|---|"]
    out += [f"| {t} | {n} |" for t, n in s["by_tier"].items()]
    out += ["", "| check | result |", "|---|---|",
            f"| faults (fired) | {s['faults']} ({s['fired']}) |",
            f"| bit-exact (of the faults that fired) | {s['exact']}/{s['fired']} = "
            f"{s['bit_exact_pct']}% |",
            f"| job runs exact | {s['runs_exact']}/{s['runs']} |",
            f"| hangs (SIGSTOP) found by the watcher | {s['hangs'] - s['hangs_past_timeout']}"
            f"/{s['hangs']} (median {s['hang_found_s_median']} s) |",
            f"| hangs past the hang timeout | {s['hangs_past_timeout']} |",
            f"| torn / wrong loads | {s['torn_loads']} |",
            f"| false hang verdicts | {s['false_hang_verdicts']} |",
            f"| false health verdicts | {s['false_health_verdicts']} |",
            f"| faults that never fired | {s['not_fired']} |",
            f"| processes a killed rank left behind (killed by the tool) | "
            f"{s['leaked_processes']} |",
            f"| median downtime per fault | {s['downtime_s_median']} s |"]
    return "\n".join(out)


# ---- the campaign ----------------------------------------------------------------------
def reference(layout: str, iters: int, opts, work: str, cache: dict):
    key = (layout, iters)
    if key not in cache:
        log = os.path.join(work, f"reference-{layout}-{iters}.log")
        job = run_job(base_args(layout, iters), max_restarts=0, timeout=opts.run_timeout,
                      log_path=log)
        if job.returncode != 0 or not job.result.hashes:
            raise SystemExit(f"chaos: the reference run of {layout} failed "
                             f"(exit {job.returncode}); see {log}")
        cache[key] = (job.result, {it: v for _, it, v in iteration_losses(job.lines)})
    return cache[key]


def run_campaign(opts, references: dict | None = None) -> tuple[dict, int]:
    """Plan, run, analyze, report. ``references``: (layout, iters) -> (RunResult, {iteration:
    logged loss}) computed elsewhere (a test's shared reference runs). Returns the
    JSON-able results and the exit code."""
    work = opts.work_dir
    os.makedirs(work, exist_ok=True)
    plans = plan_campaign(opts)
    faults = [f for p in plans for f in p.faults]
    refs = dict(references or {})
    print(f"chaos: {len(faults)} faults in {len(plans)} job runs, seed {opts.seed}, "
          f"layouts {' '.join(opts.layouts)}; logs in {work}", flush=True)
    runs, done_before = [], 0
    bar = Progress(len(faults), desc="chaos", unit="fault", every_s=opts.progress_every)
    for p in plans:
        ref, ref_losses = reference(p.layout, p.train_iters, opts, work, refs)
        job = f"chaos{os.getpid()}-{opts.seed}-{p.index}"
        ckpt = os.path.join(work, f"run{p.index}-ckpt")
        shutil.rmtree(ckpt, ignore_errors=True)
        log = os.path.join(work, f"run{p.index}.log")
        ext = [f for f in p.faults if f.origin == "external"]
        bar.write(f"run {p.index}: {p.name}, {p.train_iters} iterations, "
                  f"--inject-fault {p.inject() or '-'}"
                  f"{', REFT_WATCHER_FAULT=' + p.watcher_env() if p.watcher_env() else ''}"
                  f"{', external: ' + ', '.join(f.describe() for f in ext) if ext else ''}")
        try:
            out = run_job(fault_args(p, opts, ckpt, job), max_restarts=p.restarts(),
                          timeout=opts.run_timeout, log_path=log, externals=ext,
                          watcher_fault=p.watcher_env(), job=job,
                          on_fault=lambda: bar.update(1))
        finally:
            cleanup_shm(job)
            if not opts.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        rec = analyze(p, out, ref, ref_losses, opts)
        rec["log"] = log
        runs.append(rec)
        report_run(p, rec, bar.write)
        bar.update(max(0, done_before + len(p.faults) - bar.n))
        done_before += len(p.faults)
    bar.close()
    return finish(opts, runs, faults)


def report_run(p: RunPlan, rec: dict, write=print) -> None:
    for f in p.faults:
        write(fault_line(f))
    verdict = "exact" if rec["exact"] else "NOT EXACT: " + "; ".join(
        rec["problems"] or ["see the faults above"])
    extra = []
    if rec["false_hangs"]:
        extra.append(f"false hang verdicts {rec['false_hangs']}")
    if rec["false_health"]:
        extra.append(f"false health verdicts {rec['false_health']}")
    if rec["leaked"]:
        extra.append(f"left behind by killed ranks: {rec['leaked']}")
    write(f"run {p.index}: {verdict} ({rec['seconds']:.0f} s, {rec['restarts']} "
          f"restarts){'; ' + '; '.join(extra) if extra else ''}")


def finish(opts, runs: list, faults: list) -> tuple[dict, int]:
    """The summary table, the verdict, the JSON file; (results, exit code)."""
    s = summary(runs, faults, opts)
    print("\n== chaos campaign ==")
    print(table(s, faults))
    failed = [f"{n} {what}" for n, what in (
        (s["fired"] - s["exact"], "faults not recovered bit-exact"),
        (s["runs"] - s["runs_exact"], "job runs not exact"),
        (s["hangs_past_timeout"], "hangs past the hang timeout"),
        (s["torn_loads"], "torn / wrong loads"),
        (s["false_hang_verdicts"], "false hang verdicts"),
        (s["false_health_verdicts"], "false health verdicts")) if n]
    bad = bool(failed)
    print(f"verdict: {s['exact']}/{s['fired']} faults that fired recovered bit-exact "
          f"({s['not_fired']} never fired); "
          f"{'no other finding' if not bad else 'FAILED: ' + ', '.join(failed)}")
    results = {"command": " ".join(sys.argv), "seed": opts.seed,
               "options": {k: v for k, v in vars(opts).items() if k != "func"},
               "summary": s, "table": table(s, faults), "runs": runs,
               "faults": [dict(dataclasses.asdict(f), origin=f.origin, specs=f.specs())
                          for f in faults]}
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"results: {opts.out}")
    return results, 1 if bad else 0


def _read_log(path: str) -> list:
    """A job run's log as run_job wrote it: (time, line) per line."""
    out = []
    with open(path, errors="replace") as f:
        for raw in f:
            t, _, line = raw.rstrip("\n").partition(" ")
            try:
                out.append((float(t), line))
            except ValueError:
                if out:
                    out.append((out[-1][0], raw.rstrip("\n")))
    return out


def reanalyze(path: str, out: str = "") -> tuple[dict, int]:
    """Analyze a finished campaign again from its logs and events files (``--reanalyze
    RESULTS.json``): the plan as the file recorded it, each run's log and events, the
    references' logs; faults sent from outside keep the moment recorded."""
    with open(path) as f:
        old = json.load(f)
    opts = options([])
    for k, v in old["options"].items():
        setattr(opts, k, v)
    opts.out = out
    plan_fields = {f.name for f in dataclasses.fields(Fault)
                   if f.name in ("id", "run", "layout", "attempt", "kind", "phase", "rank",
                                 "iteration", "candidates", "delay")}
    faults, plans, refs, runs = [], [], {}, []
    for r in old["runs"]:
        fs = []
        for d in (d for d in old["faults"] if d["run"] == r["run"]):
            f = Fault(**{k: d[k] for k in plan_fields})
            if f.origin == "external":
                for k in ("fired", "t_fired", "where", "pid"):
                    setattr(f, k, d[k])
            fs.append(f)
        name, protect, save = layout_of(r["layout"])
        p = RunPlan(r["run"], name, protect, r["train_iters"], fs, r["async_save"], save)
        plans.append(p)
        faults += fs
        key = (p.layout, p.train_iters)
        if key not in refs:
            lines = _read_log(os.path.join(opts.work_dir,
                                           f"reference-{p.layout}-{p.train_iters}.log"))
            res = parse("\n".join(line for _, line in lines), 0)
            refs[key] = (res, {it: v for _, it, v in iteration_losses(lines)})
        lines = _read_log(r["log"])
        res = parse("\n".join(line for _, line in lines), r["returncode"],
                    r["log"] + ".events.jsonl")
        job = JobOutput(r["returncode"], lines, list(res.events), res, r["seconds"],
                        r["timed_out"], r["restarts"], r.get("leaked", []))
        rec = analyze(p, job, *refs[key], opts)
        rec["log"] = r["log"]
        runs.append(rec)
        report_run(p, rec)
    return finish(opts, runs, faults)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="docs/chaos.md: what is checked, the table.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=20, help="faults in all (default 20)")
    p.add_argument("--faults-per-run", type=int, default=4,
                   help="faults per job run, one per torchrun attempt (default 4)")
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS,
                   metavar="LAYOUT:PROTECT[:nosave]",
                   help=f"job runs go round these (default {' '.join(DEFAULT_LAYOUTS)}); "
                        f"nosave: no persistent checkpoints in that layout's runs")
    p.add_argument("--kinds", nargs="+", default=list(INTERNAL_KINDS + EXTERNAL_KINDS),
                   choices=KINDS, metavar="KIND",
                   help=f"fault kinds drawn from (default all; watcher-kill goes beside "
                        f"a kill while the phase flush is drawn, --flush-share): "
                        f"{', '.join(KINDS)}")
    p.add_argument("--phases", nargs="+", default=None, metavar="PHASE",
                   help="phases drawn from for faults inside the processes (default every "
                        "phase of megatron/training/fault_injection.py: "
                        f"{', '.join(available_phases())})")
    p.add_argument("--external-share", type=float, default=0.25,
                   help="share of faults sent from outside (default 0.25)")
    p.add_argument("--flush-share", type=float, default=0.2,
                   help="chance that a kill also kills a watcher mid-flush (phase flush)")
    p.add_argument("--iters", type=int, default=0,
                   help="iterations of every job run (default 4 + 3 x --faults-per-run)")
    p.add_argument("--save-interval", type=int, default=4,
                   help="persistent checkpoints every N iterations (default 4)")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="--reft-hang-timeout of the job runs (SIGSTOP faults)")
    p.add_argument("--collective-timeout-min", type=int, default=3,
                   help="--distributed-timeout-minutes: ends a hang the monitor missed")
    p.add_argument("--run-timeout", type=float, default=600.0,
                   help="seconds a job run may take before it counts as hung")
    p.add_argument("--work-dir", default="/tmp/chaos/work")
    p.add_argument("--out", default="", help="JSON results file")
    p.add_argument("--keep", action="store_true", help="keep the runs' checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--reanalyze", metavar="RESULTS.json", default="",
                   help="analyze a finished campaign again from its logs (no job runs)")
    p.add_argument("--progress-every", type=float, default=None,
                   help="seconds between progress lines off a terminal (default 10)")
    return p


def options(argv=None):
    o = parser().parse_args(argv)
    known = available_phases()
    o.phases = list(o.phases or known)
    bad = [p for p in o.phases if p not in known]
    if bad:
        raise SystemExit(f"chaos: unknown phase(s) {bad}; "
                         f"megatron/training/fault_injection.py has {', '.join(known)}")
    if "watcher-kill" in o.kinds and "flush" not in o.phases:
        o.phases.append("flush")
    o.kinds = [k for k in o.kinds if k not in WATCHER_KINDS]
    o.async_save_ok = "save-async" in o.phases
    o.run_iters = o.iters or 4 + 3 * o.faults_per_run
    return o


def main(argv=None) -> int:
    opts = options(argv)
    if opts.reanalyze:
        return reanalyze(opts.reanalyze, opts.out)[1]
    if opts.dry_run:
        for p in plan_campaign(opts):
            print(f"run {p.index}: {p.name}, {p.train_iters} iterations, --inject-fault "
                  f"{p.inject() or '-'} {p.watcher_env()}")
            for f in p.faults:
                print(f"  #{f.id} attempt {f.attempt}: {f.describe()}")
        return 0
    return run_campaign(opts)[1]


if __name__ == "__main__":
    sys.exit(main())
