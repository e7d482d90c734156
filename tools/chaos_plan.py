"""The chaos campaign's plan (tools/chaos.py): what a fault can be, and the seeded
draw of each job run's faults, attempt after attempt, so that each one can fire."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from reft_ext.testing import fault_specs
from tests.harness.run import LAYOUTS

# ---- what a fault can be -------------------------------------------------------------
INTERNAL_KINDS = ("kill", "term", "stop", "node", "corrupt", "corrupt-replica",
                  "corrupt-manifest", "corrupt-committed", "shm-full")
EXTERNAL_KINDS = ("ext-kill", "ext-stop", "ext-node")
WATCHER_KINDS = ("watcher-kill",)  # the flush phase: beside a kill on the same attempt
# a straggler (--inject-fault R:I:CONT:slow:F): beside a run's faults, stops no process
STRAGGLER_KINDS = ("slow",)
KINDS = (*INTERNAL_KINDS, *EXTERNAL_KINDS, *WATCHER_KINDS, *STRAGGLER_KINDS)
# how often each kind is drawn, relative (the corrupt modes share one weight of 2)
KIND_WEIGHT = {"kill": 3, "term": 1, "stop": 1.5, "node": 2, "corrupt": 0.5,
               "corrupt-replica": 0.5, "corrupt-manifest": 0.5, "corrupt-committed": 0.5,
               "shm-full": 0.5, "ext-kill": 1, "ext-stop": 1, "ext-node": 1}
SIGNAL_OF = {"kill": "KILL", "term": "TERM", "stop": "STOP", "shm-full": "KILL"}
WALL_CLOCK = "wall-clock"  # the phase of a fault sent from outside
SLOW_PHASE = "slow"        # the phase of a straggler: every iteration from ITER on
SLOW_FACTOR = 2            # its rank sleeps (F - 1) x its compute: twice as slow

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


# start-up moments whose ITER is the iteration a start resumes from (0 when fresh): the
# planner places a phase's ITER inside the run, so these are the in-process campaign's
# (tests/integration/test_inprocess_chaos.py), which names the resumed iteration itself
START_ONLY = ("join", "data", "on-start")


def available_phases() -> tuple[str, ...]:
    """The phases ``--inject-fault`` knows (reft_ext/testing/fault_specs.py) that this
    campaign places (not START_ONLY)."""
    return tuple(p for p in fault_specs.PHASES if p not in START_ONLY)


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
    iteration: int            # internal: ITER; external: the iteration line it follows;
                              # straggler: slow from ITER on, on every attempt
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
            "watcher" if self.kind in WATCHER_KINDS else \
            "straggler" if self.kind in STRAGGLER_KINDS else "internal"

    @property
    def stops(self) -> bool:
        """Does it stop a process (one restart each)? Not a watcher's (a kill of the same
        attempt restarts), not a straggler's (slow, never stopped)."""
        return self.origin in ("internal", "external")

    def specs(self) -> list[str]:
        """Its --inject-fault specs (several ITERs for a restart phase: the one that
        matches fires, the process dies, the others never can)."""
        if self.origin == "straggler":
            return [f"{self.rank}:{self.iteration}:CONT:slow:{SLOW_FACTOR:g}"]
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
        if self.origin == "straggler":
            return f"{SLOW_FACTOR:g}x slower (a straggler) to rank {self.rank} from " \
                   f"iteration {self.iteration}"
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
        return sum(1 for f in self.faults if f.stops)


class Planner:
    """Draws the faults of one job run, attempt after attempt, so that each one can fire:
    its iteration lies past every iteration an earlier attempt could have restored."""

    def __init__(self, rng: random.Random, opts, slow_rng: random.Random | None = None):
        self.rng, self.o, self.save = rng, opts, True
        # stragglers draw from their own generator: a seed's other faults stay the same
        # with or without them
        self.slow_rng = slow_rng or random.Random(f"{opts.seed}-slow")
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
        self.straggler(faults, index, first_id, iters)
        async_save = any(f.phase == "save-async" for f in faults)
        return RunPlan(index, layout, protect, iters, faults, async_save, save)

    def straggler(self, faults: list, index: int, first_id: int, iters: int) -> None:
        """With --slow-share's chance, a rank slowed from a random iteration on (early
        enough that some iterations run slow), appended after the run's faults."""
        o, rng = self.o, self.slow_rng
        if "slow" not in o.kinds or iters < 5 or not faults:
            return
        if rng.random() >= o.slow_share:
            return
        faults.append(Fault(first_id + len(faults), index, faults[0].layout, 0, "slow",
                            SLOW_PHASE, rng.randrange(4), rng.randint(1, iters - 4)))

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
        left -= sum(1 for f in p.faults if f.stops)
        i += 1
    return runs
