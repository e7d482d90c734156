"""Reliability model (REFT section 5) and its Monte-Carlo check.

Nodes fail independently; a node's time to failure is Weibull, survival
S(t) = exp(-lambda t^c) (t in hours). N nodes sit in N/D groups of D nodes: the nodes a
sharding group spans (the placement keeps every copy off the node of what it protects,
so one lost node per group is survivable; reft_ext/protect/placement.py).

* No repair (the paper's Figure 8): with no protection the in-memory state survives to t
  only if every node does, S^N; with protection against k failures per group, only if no
  group loses more than k nodes: [sum_{j<=k} C(D,j) (1-S)^j S^(D-j)]^(N/D).
* With repair (how a job runs): a failed node is replaced and its group is protected again
  after a window W (restart + REFT-load + the next snapshot). A failure is unrecoverable
  from memory when k more of the other D-1 members fail inside that window. Seen from a
  random moment of a stationary renewal process, a node fails within W with probability
  F_e(W) = (1/mu) int_0^W S(u) du (mu = MTBF), so the unrecoverable fraction is
  P[Binomial(D-1, F_e(W)) >= k].
* Goodput: Daly's expected time for a segment of work tau + checkpoint cost delta with
  restart R under failures of rate r (exponential): (1/r) e^{rR} (e^{r(tau+delta)} - 1).
  Without REFT every failure rolls back to the persistent checkpoint; with REFT failures
  roll back one snapshot interval, and only the unrecoverable ones (rate r q) to the
  persistent checkpoint: goodput = G(snapshot interval) x G(persistent interval, rate r q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reft_ext.plan.common import fail, positive
from reft_ext.plan.common import flag_field as _f
from reft_ext.report.progress import Progress, progress

HOUR = 3600.0


@dataclass
class ReliabilityConfig:
    """Failure rates and the costs of restarting, in hours and seconds as named."""

    node_failures_per_day: float = _f(0.008, "probability that a node fails within a day "
                                             "(docs/design.md: 0.1%% per GPU, 8 GPUs)")
    weibull_shape: float = _f(1.0, "Weibull shape c (1: exponential, < 1: infant "
                                   "mortality)")
    weibull_lambda: float | None = _f(None, "Weibull scale: S(t) = exp(-lambda t^c), t in "
                                            "hours (overrides --node-failures-per-day)")
    restart_seconds: float = _f(600.0, "detect a failure and restart the job, before any "
                                       "state is loaded")
    storage_bandwidth: float = _f(10e9, "persistent checkpoint storage, bytes/s for the "
                                        "whole job")
    lost_work_target: float = _f(0.01, "fraction of wall time that rollbacks to the "
                                       "persistent checkpoint may cost")
    persistent_interval_hours: float | None = _f(None, "persistent checkpoint interval "
                                                       "for the goodput (default: Daly's "
                                                       "optimum for the rollback rate "
                                                       "with and without REFT)")
    horizon_hours: float = _f(720.0, "time axis of the survival curves")

    def __post_init__(self):
        positive(ReliabilityConfig, self, "weibull_shape", "weibull_lambda",
                 "storage_bandwidth", "lost_work_target", "persistent_interval_hours",
                 "horizon_hours")
        if not 0 < self.node_failures_per_day < 1:
            fail("--node-failures-per-day", f"a probability in (0, 1), got "
                                            f"{self.node_failures_per_day}")
        if self.restart_seconds < 0:
            fail("--restart-seconds", "must be >= 0")
        if self.weibull_lambda is None:  # P(fail within 24 h) = p
            self.weibull_lambda = -math.log1p(-self.node_failures_per_day) / \
                24.0 ** self.weibull_shape

    @property
    def mtbf_hours(self) -> float:
        return mtbf_hours(self.weibull_lambda, self.weibull_shape)


def node_survival(t, lam: float, c: float):
    return np.exp(-lam * np.power(t, c))


def mtbf_hours(lam: float, c: float) -> float:
    return math.gamma(1 + 1 / c) * lam ** (-1 / c)


def survival(t, nodes: int, group: int, k: int, lam: float, c: float):
    """P(the in-memory state is intact at t), no repair; k = failures a group survives."""
    s = node_survival(np.asarray(t, dtype=float), lam, c)
    if k <= 0:
        return s ** nodes
    f = 1 - s
    per_group = sum(math.comb(group, j) * f ** j * s ** (group - j)
                    for j in range(min(k, group) + 1))
    return per_group ** (nodes // group)


def equilibrium_cdf(w_hours: float, lam: float, c: float, points: int = 4001) -> float:
    """F_e(W): probability that a node of a stationary renewal process fails within W."""
    if w_hours <= 0:
        return 0.0
    u = np.linspace(0.0, w_hours, points)
    return float(np.trapezoid(node_survival(u, lam, c), u)) / mtbf_hours(lam, c)


def unrecoverable_fraction(w_hours: float, group: int, k: int, lam: float, c: float) -> float:
    """Fraction of failures after which a group cannot rebuild from memory."""
    if k <= 0:
        return 1.0
    p, n = equilibrium_cdf(w_hours, lam, c), group - 1
    return float(sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1)))


def segment_time(work: float, cost: float, restart: float, rate: float) -> float:
    """Daly: expected wall time to finish ``work + cost`` when failures (rate per the
    same time unit) restart it after ``restart``."""
    if rate <= 0:
        return work + cost
    return math.expm1(rate * (work + cost)) * math.exp(rate * restart) / rate


def goodput(work: float, cost: float, restart: float, rate: float) -> float:
    return work / segment_time(work, cost, restart, rate) if work > 0 else 0.0


def daly_interval(cost: float, rate: float) -> float:
    """Young/Daly first-order optimum of the checkpoint interval."""
    return math.sqrt(2 * cost / rate) if rate > 0 and cost > 0 else math.inf


def interval_for_target(rate: float, target: float) -> float:
    """Interval whose rollbacks (half an interval each, ``rate`` per time) cost
    ``target`` of the time."""
    return 2 * target / rate if rate > 0 else math.inf


# ---- Monte Carlo -----------------------------------------------------------------------
def weibull_samples(rng, lam: float, c: float, size):
    return (rng.exponential(1.0, size) / lam) ** (1 / c)


def simulate_survival(t, nodes: int, group: int, k: int, lam: float, c: float,
                      trials: int, rng) -> np.ndarray:
    """No repair: the state is lost when some group has lost k + 1 nodes."""
    times = np.sort(weibull_samples(rng, lam, c, (trials, nodes // group, group)), axis=2)
    death = times[:, :, min(k, group - 1)].min(axis=1) if k < group else np.inf
    return (death[:, None] > np.asarray(t, dtype=float)[None, :]).mean(axis=0)


def simulate_unrecoverable(group: int, k: int, lam: float, c: float, w_hours: float,
                           horizon: float, groups: int, rng, show_progress: bool = True) -> float:
    """Renewal processes (a failed node is replaced at once by a fresh one); fraction of
    failures, after a burn-in, followed within W by failures of >= k other members.
    Progress over the groups goes to stderr (it takes no random draws: same results)."""
    burn, hits, total = horizon * 0.1, 0, 0
    mean = mtbf_hours(lam, c)
    for _ in progress(range(groups), desc="monte-carlo unrecoverable", unit="group",
                      disable=not show_progress):
        fails = []
        for _ in range(group):
            n = int(horizon / mean * 1.5) + 50
            t = np.cumsum(weibull_samples(rng, lam, c, n))
            while t[-1] < horizon + w_hours:
                t = np.concatenate([t, t[-1] + np.cumsum(weibull_samples(rng, lam, c, n))])
            fails.append(t)
        for a in range(group):
            t0 = fails[a][(fails[a] > burn) & (fails[a] < horizon)]
            others = np.zeros(len(t0), dtype=int)
            for b in range(group):
                if b != a:
                    lo = np.searchsorted(fails[b], t0, side="right")
                    hi = np.searchsorted(fails[b], t0 + w_hours, side="right")
                    others += hi > lo
            hits += int((others >= k).sum())
            total += len(t0)
    return hits / total


def simulate_goodput(rate: float, q: float, snap_every: float, snap_cost: float,
                     restart_mem: float, persist_every: float, persist_cost: float,
                     restart_persist: float, work: float, rng,
                     show_progress: bool = True) -> float:
    """Event-driven run of ``work`` hours of training: exponential failures of ``rate``;
    with probability q a failure rolls back to the last persistent checkpoint, otherwise
    to the last snapshot; failures may also hit a restart (which then starts again).
    Progress (the most work done so far, of ``work`` hours) goes to stderr
    (it takes no random draws: same results)."""
    done = safe_mem = safe_persist = wall = 0.0
    slow = 1 + snap_cost / snap_every  # snapshot overhead spread over the interval
    next_fail = rng.exponential(1 / rate)
    with Progress(work, "monte-carlo goodput", unit="h", disable=not show_progress) as bar:
        while done < work:
            if done > bar.n:  # high-water mark: rollbacks do not move the bar back
                bar.update(done - bar.n)
            # time to the next persistent checkpoint boundary (or the end)
            target = min(work, (math.floor(done / persist_every + 1e-9) + 1) * persist_every)
            need = (target - done) * slow + (persist_cost if target < work else 0.0)
            if wall + need <= next_fail:
                wall, done = wall + need, target
                safe_persist = safe_mem = done
                continue
            # failure before the boundary: progress up to it, then roll back
            done += (next_fail - wall) / slow
            done = min(done, target)
            safe_mem = max(safe_mem, math.floor(done / snap_every) * snap_every)
            wall = next_fail
            persist = rng.random() < q
            done = safe_persist if persist else max(safe_mem, safe_persist)
            safe_mem = done
            restart = restart_persist if persist else restart_mem
            while True:  # the restart itself can be hit
                gap = rng.exponential(1 / rate)
                if gap >= restart:
                    wall += restart
                    next_fail = wall + gap - restart
                    break
                wall += gap
        bar.update(done - bar.n)
    return work / wall


# ---- a planned job ----------------------------------------------------------------------
def unprotected_reason(plan, disjoint: bool, group: int = 2) -> str | None:
    """Why a lost node is not recoverable from host memory under this plan (the model's
    0 protected failures per group), or None when one per group is."""
    par, scheme = plan.par, plan.snap.protect
    if plan.redundancy == "none":
        return f"--reft-protect {scheme} keeps no copy of a rank's slice on another node"
    if plan.placement_error is not None:
        return f"no valid placement ({plan.placement_error})"
    if par.use_distributed_optimizer and not plan.snap.aor:
        return (f"the ZeRO-1 optimizer shards (--use-distributed-optimizer) have no copy "
                f"on another node under --reft-protect {scheme}: a lost node's shards are "
                f"gone, so every node loss falls back to the persistent checkpoint; "
                f"--reft-protect {scheme},aor covers them")
    if group <= 1:
        return "each sharding group lives on one node: a node loss takes every copy"
    if not disjoint:
        return ("the sharding groups share nodes unevenly: one node loss can cost a group "
                "two members")
    return None


class JobReliability:
    """The reliability model applied to a :class:`reft_ext.plan.planner.Plan`."""

    def __init__(self, plan, cfg: ReliabilityConfig):
        self.plan, self.cfg = plan, cfg
        par = plan.par
        lam, c = cfg.weibull_lambda, cfg.weibull_shape
        # a group of nodes: those a sharding group spans (several members per node: the
        # placement keeps each redundancy on another node, reft_ext/protect/placement.py)
        groups = {frozenset(plan.reft.node_of(r) for r in g) for g in par.dp_groups()}
        self.nodes, self.group = par.nodes, max(len(g) for g in groups)
        self.disjoint = self.group > 1 and all(len(g) == self.group for g in groups) and \
            sum(len(g) for g in groups) == len({n for g in groups for n in g})
        self.why_unprotected = unprotected_reason(plan, self.disjoint, self.group)
        self.k = 0 if self.why_unprotected else 1
        self.rate = self.nodes / mtbf_hours(lam, c)            # failures per hour
        self.snap_interval = plan.snap.snapshot_every * plan.t_iter / HOUR
        self.load_mem = plan.load_node_lost if plan.load_node_lost is not None \
            else plan.load_crash
        self.persist_seconds = plan.state_bytes / cfg.storage_bandwidth
        self.window = (cfg.restart_seconds + self.load_mem) / HOUR + self.snap_interval
        self.q = unrecoverable_fraction(self.window, self.group, self.k, lam, c)
        delta = self.persist_seconds / HOUR
        r_persist = (cfg.restart_seconds + self.persist_seconds) / HOUR
        r_mem = (cfg.restart_seconds + self.load_mem) / HOUR
        target = cfg.lost_work_target
        self.interval_target = {"without": interval_for_target(self.rate, target),
                                "with": interval_for_target(self.rate * self.q, target)}
        given = cfg.persistent_interval_hours
        self.interval = {  # goodput uses each side's Daly optimum unless one is given
            "without": given or min(daly_interval(delta, self.rate), cfg.horizon_hours),
            "with": given or min(daly_interval(delta, self.rate * self.q),
                                 cfg.horizon_hours)}
        self.goodput = {
            "without": goodput(self.interval["without"], delta, r_persist, self.rate),
            "with": goodput(self.snap_interval, plan.overhead_fraction * self.snap_interval,
                            r_mem, self.rate * (1 - self.q))
            * goodput(self.interval["with"], delta, r_persist, self.rate * self.q)}

    def curves(self, points: int = 200) -> dict:
        """Survival over time (no repair): none, single-failure, two-failure protection."""
        t = np.linspace(0, self.cfg.horizon_hours, points)
        lam, c = self.cfg.weibull_lambda, self.cfg.weibull_shape
        return {"hours": t, **{name: survival(t, self.nodes, self.group, k, lam, c)
                               for name, k in (("none", 0), ("single", 1), ("double", 2))}}

    def hours_until(self, probability: float) -> dict:
        """How long the in-memory state survives with ``probability`` (no repair)."""
        lam, c = self.cfg.weibull_lambda, self.cfg.weibull_shape
        out = {}
        for name, k in (("none", 0), ("single", 1), ("double", 2)):
            lo, hi = 0.0, 1e7
            for _ in range(100):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if survival(mid, self.nodes, self.group, k, lam, c) \
                    >= probability else (lo, mid)
            out[name] = lo
        return out

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "group": self.group, "protected_failures": self.k,
                "mtbf_node_hours": self.cfg.mtbf_hours, "failures_per_day": 24 * self.rate,
                "weibull_lambda": self.cfg.weibull_lambda, "weibull_shape": self.cfg.weibull_shape,
                "window_hours": self.window, "unrecoverable_fraction": self.q,
                "unprotected_because": self.why_unprotected,
                "persistent_save_seconds": self.persist_seconds,
                "persistent_interval_hours_for_target": self.interval_target,
                "persistent_interval_hours": self.interval, "goodput": self.goodput,
                "hours_until_99": self.hours_until(0.99)}
