"""Health check before resuming, DLRover's node check: every rank runs a small matmul
against a float64 reference, and the nodes run all-gathers in pairs; the members of a
pair that failed are regrouped in a second round with nodes that passed, which names the
bad node. Every rank ends with the same verdict (gathered over a gloo group).

Library only (no megatron.training): ``run_health_check`` returns a ``HealthReport``; the
trainer's call site (megatron/training/startup_health_check.py) decides what happens to a
failed node. Flags: ``HealthConfig`` (reft_ext/cluster/health_config.py).
"""

from __future__ import annotations

import datetime
import statistics
import time
from dataclasses import dataclass, field

import torch

from reft_ext.cluster.health_config import ALLGATHER, MATMUL
PAYLOAD_ELEMS = 1 << 16   # 256 KiB of int32 per rank and round: a correctness probe
MATMUL_RTOL = 1e-2        # of the reference's largest entry: TF32 on a GPU passes,
                          # a NaN, a flipped exponent or garbage does not
SLOW_FACTOR = 3.0         # a rank this much slower than the median is reported


# ---- the pairing, pure Python (tests/integration/test_health.py checks it without processes) -----
def pair_nodes(nodes: list[int]) -> list[tuple[int, ...]]:
    """Round 1: (0, 1), (2, 3), ...; an odd last node joins the last pair (a triple),
    so every node is in exactly one group; a single node is a group of its own."""
    nodes = sorted(nodes)
    if len(nodes) < 2:
        return [tuple(nodes)] if nodes else []
    groups = [tuple(nodes[i:i + 2]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
        groups[-1] = groups[-1] + (nodes[-1],)
    return groups


def regroup(suspects: list[int], good: list[int]) -> list[list[tuple[int, int]]]:
    """Round 2: each member of a failed group with a node that passed round 1, in
    sub-rounds so that a good node is in one group at a time. Empty when no node passed
    (nothing trustworthy to compare with)."""
    if not good:
        return []
    return [[(s, good[j]) for j, s in enumerate(suspects[k:k + len(good)])]
            for k in range(0, len(suspects), len(good))]


@dataclass
class Failure:
    node: int
    check: str    # MATMUL or ALLGATHER
    reason: str


def judge(nodes: list[int], matmul_bad: dict[int, str],
          round1: dict[tuple, tuple[bool, str]], round2: dict[tuple, tuple[bool, str]]):
    """(failures, unresolved, notes) from the per-group results; same on every rank.

    A node fails the all-gather check when its round-1 group failed and so did its
    round-2 pair with a node known to be good. Both members of a failed pair passing
    round 2 points at the link between them, not at a node: a note, nobody excluded."""
    failures = [Failure(n, MATMUL, why) for n, why in sorted(matmul_bad.items())]
    failed = [g for g, (ok, _) in round1.items() if not ok]
    suspects = sorted({n for g in failed for n in g})
    good = sorted(n for g, (ok, _) in round1.items() if ok for n in g if n not in matmul_bad)
    if suspects and not good:
        return failures, (f"nodes {suspects} failed the all-gather check and no node "
                          f"passed it to regroup them with: cannot tell which node is "
                          f"bad ({round1[failed[0]][1]})"), []
    notes, cleared = [], set()
    for s in suspects:
        pair = next(p for p in round2 if p[0] == s)
        ok, why = round2[pair]
        g1 = next(g for g in failed if s in g)
        if ok:
            cleared.add(s)
        else:
            failures.append(Failure(s, ALLGATHER, f"round 1 with nodes {list(g1)} failed "
                                    f"({round1[g1][1]}), round 2 with node {pair[1]} "
                                    f"failed ({why})"))
    for g in failed:
        if all(n in cleared for n in g):
            notes.append(f"the all-gather of nodes {list(g)} failed in round 1 "
                         f"({round1[g][1]}) but each passed round 2 with another node: "
                         f"the link between them, not a node")
    return failures, "", notes


# ---- the checks -------------------------------------------------------------------
def matmul_check(size: int, seed: int = 1234, device: str = "cpu",
                 corrupt: bool = False) -> tuple[bool, str, float]:
    """(ok, detail, ms): fixed inputs from ``seed``, float32 product on ``device``
    against a float64 product on the CPU. ``corrupt``: the injected failure, a wrong
    entry as a faulty unit would produce."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(size, size, generator=g, dtype=torch.float64) - 0.5
    b = torch.rand(size, size, generator=g, dtype=torch.float64) - 0.5
    ref = a @ b
    a32, b32 = a.float().to(device), b.float().to(device)
    t0 = time.perf_counter()
    c = a32 @ b32
    if c.is_cuda:
        torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0)
    c = c.double().cpu()
    if corrupt:
        c[size // 2, size // 3] += 1.0
    tol = MATMUL_RTOL * ref.abs().max().item()
    if not torch.isfinite(c).all():
        return False, f"{int((~torch.isfinite(c)).sum())} non-finite entries", ms
    err = (c - ref).abs().max().item()
    if err > tol:
        return False, (f"max error {err:.3g} against the float64 reference (tolerance "
                       f"{tol:.3g}, {size}x{size})"), ms
    return True, f"max error {err:.2g}", ms


def payload(rank: int) -> torch.Tensor:
    """What ``rank`` contributes: a pattern every receiver can recompute."""
    i = torch.arange(PAYLOAD_ELEMS, dtype=torch.int64)
    return ((i * 2654435761 + rank * 40503 + 17) % 2147483647).to(torch.int32)


def _allgather_check(pg, ranks: list[int], rank: int, corrupt: bool) -> tuple[bool, str, float]:
    """All-gather in ``pg`` (members ``ranks``); check every contribution."""
    mine = payload(rank)
    if corrupt:
        mine[PAYLOAD_ELEMS // 2] ^= 1
    out = [torch.empty_like(mine) for _ in ranks]
    t0 = time.perf_counter()
    try:
        torch.distributed.all_gather(out, mine, group=pg)
    except RuntimeError as exc:  # a timeout, a peer gone
        return False, f"rank {rank}: {type(exc).__name__}: {str(exc)[:200]}", 0.0
    ms = 1000 * (time.perf_counter() - t0)
    bad = [(r, int((t != payload(r)).sum())) for r, t in zip(ranks, out) if r != rank]
    bad = [(r, n) for r, n in bad if n]
    if bad:
        r, n = bad[0]
        return False, (f"rank {rank} received a wrong payload from rank {r} ({n} of "
                       f"{PAYLOAD_ELEMS} elements differ)"), ms
    return True, "", ms


@dataclass
class HealthReport:
    nodes: list[int]
    node_ranks: dict[int, list[int]]
    failures: list[Failure]
    unresolved: str = ""
    notes: list[str] = field(default_factory=list)
    matmul_ms: dict[int, float] = field(default_factory=dict)
    allgather_ms: dict[tuple, float] = field(default_factory=dict)
    info: list = field(default_factory=list)   # per rank: what the caller asked to gather
    seconds: float = 0.0
    size: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures and not self.unresolved

    @property
    def bad_nodes(self) -> list[int]:
        return sorted({f.node for f in self.failures})

    def lines(self) -> list[str]:
        """What every rank logs (without the ``[REFT] health: `` prefix)."""
        out = [f"node {f.node} (ranks {self.node_ranks[f.node]}) failed the {f.check} "
               f"check: {f.reason}" for f in self.failures]
        if self.unresolved:
            out.append(self.unresolved)
        out += self.notes
        ms = self.matmul_ms
        if ms:
            med = statistics.median(ms.values())
            out += [f"rank {r} is slow: matmul {t:.1f} ms, {t / med:.1f}x the median "
                    f"{med:.1f} ms" for r, t in sorted(ms.items())
                    if med > 0 and t > SLOW_FACTOR * med and t > 1.0]
        if self.ok:
            worst = max(ms, key=ms.get) if ms else 0
            ag = max(self.allgather_ms.values(), default=0.0)
            pairs = (f"all-gather in groups {[list(g) for g in self.allgather_ms]}: max "
                     f"{ag:.1f} ms" if self.allgather_ms else
                     "no all-gather rounds: a rejoin over groups just connected")
            out.append(f"{len(self.nodes)} node(s) passed in {1000 * self.seconds:.0f} ms "
                       f"(matmul {self.size}x{self.size}: max {ms.get(worst, 0):.1f} ms on "
                       f"rank {worst}; {pairs})")
        return out


def _groups(all_groups: list[tuple], node_ranks, timeout, rank):
    """Create one gloo group per node group (every rank calls new_group for each, in
    the same order, as torch requires); returns (node group, ranks, pg) for this rank's."""
    mine = None
    for g in all_groups:
        ranks = sorted(r for n in g for r in node_ranks[n])  # = group rank order
        pg = torch.distributed.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            mine = (g, ranks, pg)
    return mine


def _run_round(groups, node_ranks, rank, timeout, corrupt, pgs: list) -> dict | None:
    mine = _groups(groups, node_ranks, timeout, rank)
    if mine is None:
        return None
    g, ranks, pg = mine
    res = (True, "", 0.0) if len(ranks) < 2 else _allgather_check(pg, ranks, rank, corrupt)
    # destroyed after the next gather on the control group: a member that finished
    # first must not close its sockets under a peer still receiving
    pgs.append(pg)
    return {"group": g, "ok": res[0], "detail": res[1], "ms": res[2]}


def _merge(results: list[dict]) -> dict[tuple, tuple[bool, str]]:
    """Per-rank round results -> group: (ok, first failing rank's detail)."""
    out: dict[tuple, tuple[bool, str]] = {}
    for r in results:
        if r is None:
            continue
        ok, why = out.get(r["group"], (True, ""))
        out[r["group"]] = (ok and r["ok"], why or ("" if r["ok"] else r["detail"]))
    return out


def run_health_check(rank: int, world_size: int, ranks_per_node: int, *,
                     matmul_size: int = 256, timeout_s: float = 60.0,
                     inject: tuple[int, str] | None = None, info=None,
                     device: str = "cpu", rejoin: bool = False) -> HealthReport:
    """Collective over the default process group's ranks. ``inject`` = (node, check):
    that node's matmul result or all-gather payload is corrupted (tests, demos).
    ``info``: any picklable value of this rank, returned in ``report.info``.
    ``rejoin`` (every rank alike): the ranks meet again in a generation of an
    in-process restart, over groups that have just connected every pair of them: the
    matmul of every rank and one gather on the default group, no pair rounds (their
    groups and all-gathers are most of the check's time, on the survivors' path)."""
    t0 = time.perf_counter()
    timeout = datetime.timedelta(seconds=timeout_s)
    node_ranks = {n: list(range(n * ranks_per_node, (n + 1) * ranks_per_node))
                  for n in range(world_size // ranks_per_node)}
    nodes, node = sorted(node_ranks), rank // ranks_per_node
    control = None if rejoin else torch.distributed.new_group(backend="gloo",
                                                               timeout=timeout)
    bad_mm = inject is not None and inject == (node, MATMUL)
    bad_ag = inject is not None and inject == (node, ALLGATHER)
    mm = matmul_check(matmul_size, device=device, corrupt=bad_mm)
    pgs: list = []
    r1 = None if rejoin else _run_round(pair_nodes(nodes), node_ranks, rank, timeout,
                                        bad_ag, pgs)
    gathered = [None] * world_size
    # a rejoin gathers its info now, on the default group: the one collective it makes
    torch.distributed.all_gather_object(gathered, (mm, r1, info) if rejoin else (mm, r1),
                                        group=control)
    round1 = _merge([g[1] for g in gathered])
    matmul_bad = {}
    for r, ((ok, why, _), *_) in enumerate(gathered):
        if not ok and r // ranks_per_node not in matmul_bad:
            matmul_bad[r // ranks_per_node] = f"rank {r}: {why}"
    suspects = sorted({n for g, (ok, _) in round1.items() if not ok for n in g})
    good = sorted(n for g, (ok, _) in round1.items() if ok for n in g if n not in matmul_bad)
    r2 = [_run_round(sub, node_ranks, rank, timeout, bad_ag, pgs)
          for sub in regroup(suspects, good)]
    final = [([], g[2]) for g in gathered] if rejoin else [None] * world_size
    if not rejoin:
        torch.distributed.all_gather_object(final, (r2, info), group=control)
    round2 = _merge([x for f in final for x in f[0]])
    failures, unresolved, notes = judge(nodes, matmul_bad, round1, round2)
    for pg in [*pgs, control]:
        if pg is not None:  # a rejoin made no groups
            torch.distributed.destroy_process_group(pg)
    ag_ms: dict[tuple, float] = {}
    for g in [g[1] for g in gathered]:
        if g is not None:
            ag_ms[g["group"]] = max(ag_ms.get(g["group"], 0.0), g["ms"])
    return HealthReport(nodes, node_ranks, failures, unresolved, notes,
                        {r: g[0][2] for r, g in enumerate(gathered)}, ag_ms,
                        [f[1] for f in final], time.perf_counter() - t0, matmul_size)
