"""The snapshot plan of a layout: per stage the state, the slices, the timing of Algorithm
1 and the host memory of every protection scheme, from the code real snapshots run:

* sizes: :func:`reft_ext.plan.state.rank_snapshot` (``StateLayout`` + ``snapshot_regions``
  over meta tensors),
* placement: ``ReftConfig.node_of`` / ``check_placement`` (reft_ext/protect/placement.py),
* bubbles and the tier split: ``reft_ext.save.bubbles`` (the HAS scheduler's arithmetic).

Estimates that are this module's own (hardware figures in, seconds out) are marked as such
in docs/planner.md: FLOPs -> t_fb, the tier-2 interference, REFT-load's byte movements.
"""

from __future__ import annotations

from dataclasses import dataclass

from reft_ext.save.bubbles import bubble_time, iteration_time, snapshot_time, tier_split
from reft_ext.config import AUTO_LOCAL_NODES, ReftConfig, ReftConfigError
from reft_ext.plan.common import PlanConfigError, fail, positive
from reft_ext.plan.common import flag_field as _f
from reft_ext.plan.hardware import HardwareConfig
from reft_ext.plan.model import ModelConfig, ParallelConfig
from reft_ext.plan.state import RankSnapshot, rank_snapshot
from reft_ext.protect.placement import check_placement

ADAM_HOST_BYTES = 4 + 2 * 12  # AOR's CPU step per element: read grad, read+write p, m, v


@dataclass
class SnapshotConfig:
    """REFT's settings as the planner needs them (names as the trainer's flags)."""

    protect: str = _f("arc", "protection to plan for: none, arc, aec, each combinable with "
                             "aor (e.g. arc,aor)", "--reft-protect")
    snapshot_every: int = _f(1, "snapshot every N iterations", "--reft-snapshot-every")
    keep: int = _f(0, "snapshots per rank in host memory (>= 3: commits on each rank "
                      "alone; 2: an all-reduce of the whole job per snapshot; 0: auto, 3 "
                      "above 16 nodes)", "--reft-keep")
    copy_interference: float = _f(0.05, "slow-down of compute while a tier-2 copy runs "
                                        "beside it, as a fraction of the copy's duration")

    def __post_init__(self):
        try:
            self.reft = ReftConfig(snapshot_every=self.snapshot_every, protect=self.protect,
                                   ranks_per_node=1, job_id="plan", keep=self.keep)
        except ReftConfigError as exc:
            raise PlanConfigError(str(exc)) from None
        self.protect = self.reft.protect
        positive(SnapshotConfig, self, "snapshot_every")
        if not 0 <= self.copy_interference <= 1:
            fail("--copy-interference", f"a fraction in [0, 1], got {self.copy_interference}")

    @property
    def aor(self) -> bool:
        return "aor" in self.protect.split(",")

    def keep_for(self, nodes: int) -> int:
        """--reft-keep for a job of ``nodes`` nodes (0: the trainer's auto rule)."""
        if self.keep:
            return self.keep
        return 3 if nodes > AUTO_LOCAL_NODES else 2


def schemes(par: ParallelConfig) -> list[str]:
    """The protection schemes a layout can use (arc/aec need D >= 2, aor ZeRO-1)."""
    out = ["none"] + (["arc", "aec"] if par.dp >= 2 else [])
    if par.use_distributed_optimizer and par.dp >= 2:
        out += ["arc,aor", "aec,aor"]
    return out


def aor_replica_bytes(snap: RankSnapshot) -> int:
    """AOR's replica of the peer's shard: fp32 main params + Adam m and v, 12 bytes an
    element (docs/aor.md; the peer's shard has the size of this rank's, up to padding)."""
    return 12 * snap.param_shard_numel


def host_bytes(snap: RankSnapshot, aor: bool, keep: int = 3) -> int:
    """Host memory of one rank: ``keep`` slots (reft_ext/save/snapshotter.py
    ``_check_memory``); with AOR each slot also holds a copy of the replica, which lives
    on the host as well, next to a receive buffer (peer's fp32 gradient shard) and a send
    buffer (its own)."""
    if not aor:
        return keep * snap.slot_bytes
    replica = aor_replica_bytes(snap)
    return keep * (snap.slot_bytes + replica) + replica + 2 * 4 * snap.param_shard_numel


@dataclass
class StagePlan:
    """One pipeline stage, for its largest member (members differ by ZeRO-1 padding)."""

    stage: int
    params: int                  # parameter elements per rank
    model_bytes: int
    optimizer_bytes: int
    replicated_bytes: int
    owned_bytes: int
    slice_bytes: int
    redundancy_bytes: int
    slot_bytes: int
    d2h_bytes: int               # copied device -> host per snapshot
    t_fb: float                  # fwd + bwd of one micro-batch on the stage
    compute: float               # m * t_fb
    bubble_1f1b: float
    bubble_interleaved: float | None
    t_snapshot: float
    bubble_bytes: int            # tier 1 (in bubbles)
    rest_bytes: int              # tier 2 (beside compute)
    overhead: float              # seconds per iteration
    host_busy: float             # seconds of the node's host memory bandwidth per snapshot
    load_crash: float            # REFT-load after a crash: every slice in its own memory
    load_node_lost: float | None  # one node lost (None: memory cannot cover it)
    device_memory: int


class Plan:
    """Everything the planner says about one layout; ``to_dict()`` for --json."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig,
                 hardware: HardwareConfig, snapshot: SnapshotConfig):
        parallel.check(model)
        self.model, self.par, self.hw, self.snap = model, parallel, hardware, snapshot
        par = parallel
        self.reft = ReftConfig(snapshot_every=snapshot.snapshot_every, protect=snapshot.protect,
                               ranks_per_node=par.ranks_per_node, job_id="plan")
        self.redundancy = self.reft.redundancy
        if self.redundancy != "none" and par.dp < 2:
            fail("--reft-protect", f"{self.redundancy} needs --data-parallel-size >= 2")
        if snapshot.aor and not par.use_distributed_optimizer:
            fail("--reft-protect", "aor protects ZeRO-1 optimizer shards: it needs "
                                   "--use-distributed-optimizer")
        self.placement_error = None
        try:
            check_placement(self.reft, par.world_size, par.dp_groups())
        except ReftConfigError as exc:
            self.placement_error = str(exc)
        # one layout per (stage, member) and scheme: TP ranks of a stage are alike
        self._snaps = {}
        self.schemes = schemes(par)
        self.vpp = par.vpp(model)
        self.stages = [self._stage(p) for p in range(par.pp)]
        self.t_iter = iteration_time(par.pp, par.num_microbatches,
                                     max(s.t_fb for s in self.stages), self.vpp)
        self.host_memory = {s: self._host_memory(s) for s in self.schemes}

    # ---- per rank -------------------------------------------------------------------
    def snapshot_of(self, stage: int, member: int, redundancy: str | None = None):
        key = (stage, member, redundancy or self.redundancy)
        if key not in self._snaps:
            rank = self.par.rank(0, member, stage)
            self._snaps[key] = rank_snapshot(self.model, self.par, rank, key[2],
                                             self.reft.node_of)
        return self._snaps[key]

    def rank(self, rank: int) -> RankSnapshot:
        """The snapshot of one global rank, as its manifest would size and place it."""
        return rank_snapshot(self.model, self.par, rank, self.redundancy, self.reft.node_of)

    def ranks_of_node(self, node: int) -> list[int]:
        if not hasattr(self, "_nodes"):
            self._nodes = {}
            for r in range(self.par.world_size):
                self._nodes.setdefault(self.reft.node_of(r), []).append(r)
        return self._nodes.get(node, [])

    # ---- host memory ----------------------------------------------------------------
    def _host_memory(self, scheme: str) -> dict:
        """Largest node: snapshot host memory, and its ratio to the node's model+optimizer
        state (the paper: at most ~3x)."""
        red = scheme.split(",")[0] if scheme != "aor" else "none"
        aor = "aor" in scheme
        worst = (0, 0)
        for node in range(self.par.nodes):
            mem = state = 0
            for r in self.ranks_of_node(node):
                _, dp, pp = self.par.coords(r)
                s = self.snapshot_of(pp, dp, red)
                mem += host_bytes(s, aor, self.snap.keep_for(self.par.nodes))
                state += s.state_bytes
            worst = max(worst, (mem, state))
        return {"bytes": worst[0], "state_bytes": worst[1],
                "ratio": worst[0] / worst[1] if worst[1] else 0.0,
                "fits": worst[0] <= self.hw.host_memory}

    # ---- per stage ------------------------------------------------------------------
    def _stage(self, p: int) -> StagePlan:
        m, par, hw, model = self.par.num_microbatches, self.par, self.hw, self.model
        members = [self.snapshot_of(p, d) for d in range(par.dp)]
        s = max(members, key=lambda x: (x.slot_bytes, x.state_bytes))
        aor = self.snap.aor
        d2h = s.slot_bytes + (4 * s.param_shard_numel if aor else 0)
        tokens = par.micro_batch_size * model.seq_length
        layers = model.num_layers // par.pp
        flops = layers * model.layer_flops(tokens) + \
            (model.logits_flops(tokens) if p == par.pp - 1 else 0)
        t_fb = flops / par.tp / hw.achieved_flops
        b1 = bubble_time(par.pp, t_fb, 1)
        bi = bubble_time(par.pp, t_fb, self.vpp) if self.vpp > 1 else None
        t_xor = (s.slice_bytes + s.regions["redundancy"][1]) / hw.device_memory_bandwidth \
            if self.redundancy == "aec" else 0.0
        t_snap = snapshot_time(d2h, hw.d2h_bandwidth) + t_xor
        tier = tier_split(d2h, t_snap, bi if bi is not None else b1)
        compute = m * t_fb
        t_rest = t_snap * tier.rest_bytes / d2h if d2h else 0.0
        dev = self.snap.copy_interference * min(t_rest, compute) + max(0.0, t_rest - compute)
        # host memory traffic: the snapshot lands in host memory; AOR also copies the
        # replica into the slot and runs Adam on the peer's shard on the CPU
        per_rank_host = d2h + (2 * aor_replica_bytes(s) + ADAM_HOST_BYTES
                               * s.param_shard_numel if aor else 0)
        host = par.ranks_per_node * per_rank_host / hw.host_memory_bandwidth
        t_iter = iteration_time(par.pp, m, t_fb, self.vpp) * self.snap.snapshot_every
        overhead = (dev + max(0.0, host - t_iter)) / self.snap.snapshot_every
        crash, lost = self._load_times(s)
        return StagePlan(
            stage=p, params=s.params,
            model_bytes=s.model_bytes, optimizer_bytes=s.optimizer_bytes,
            replicated_bytes=s.layout.replicated.nbytes, owned_bytes=s.layout.owned.nbytes,
            slice_bytes=s.slice_bytes, redundancy_bytes=s.regions["redundancy"][1],
            slot_bytes=s.slot_bytes, d2h_bytes=d2h, t_fb=t_fb, compute=compute,
            bubble_1f1b=b1, bubble_interleaved=bi, t_snapshot=t_snap,
            bubble_bytes=tier.bubble_bytes, rest_bytes=tier.rest_bytes, overhead=overhead,
            host_busy=host, load_crash=crash, load_node_lost=lost,
            device_memory=self._device_memory(p, s))

    def _load_times(self, s: RankSnapshot) -> tuple[float, float | None]:
        """REFT-load estimate (docs/reft.md): read own slice + owned state from host
        memory, exchange slices inside the sharding group (a node's ranks share its NICs),
        copy the state back to the device; a lost node's replacement receives its whole
        state, AEC decodes on the host. No restart time (see the reliability model)."""
        par, hw, D = self.par, self.hw, self.par.dp
        k = par.ranks_per_node
        owned, sl = s.layout.owned.nbytes, s.slice_bytes
        read = k * (sl + owned) / hw.host_memory_bandwidth
        need = max(0, D - 1 - (1 if self.redundancy == "arc" else 0))
        exchange = k * need * sl / hw.network_bandwidth
        h2d = (s.layout.replicated.nbytes + owned) / hw.d2h_bandwidth
        crash = read + exchange + h2d
        if self.redundancy == "none" or (owned and not self.snap.aor) or D < 2:
            return crash, None
        receive = k * (s.layout.padded + owned) / hw.network_bandwidth  # AOR: from replica
        decode = k * (D - 1) * sl / hw.host_memory_bandwidth if self.redundancy == "aec" \
            else 0.0
        return crash, read + max(exchange, receive) + decode + h2d

    def _device_memory(self, p: int, s: RankSnapshot) -> int:
        """Weights + fp32 gradient buffer + optimizer state + activations (Korthikanti et
        al.: 34 s b h / TP bytes per layer with selective recomputation, + 5 a s^2 b / TP
        without, 2 s b h with full; in flight: 1F1B warm-up of the stage)."""
        model, par = self.model, self.par
        sbh = model.seq_length * par.micro_batch_size * model.hidden_size
        per_layer = {"selective": 34 * sbh / par.tp, "full": 2 * sbh,
                     "none": 34 * sbh / par.tp + 5 * model.num_attention_heads
                     * model.seq_length ** 2 * par.micro_batch_size / par.tp}
        chunk_layers = model.num_layers // par.pp // self.vpp
        if self.vpp > 1:
            inflight = min((par.pp - p - 1) * 2 + (self.vpp - 1) * par.pp + 1,
                           par.num_microbatches * self.vpp)
        else:
            inflight = min(par.pp - p, par.num_microbatches)
        act = inflight * chunk_layers * per_layer[par.recompute_granularity]
        return int(s.model_bytes + 4 * s.params + s.optimizer_bytes + act)

    # ---- summary --------------------------------------------------------------------
    @property
    def overhead_fraction(self) -> float:
        return max(s.overhead for s in self.stages) / self.t_iter

    @property
    def load_crash(self) -> float:
        return max(s.load_crash for s in self.stages)

    @property
    def load_node_lost(self) -> float | None:
        """None: a lost node is not recoverable from memory (no redundancy, ZeRO-1
        shards without AOR, or a placement that puts two members in one node)."""
        times = [s.load_node_lost for s in self.stages]
        return None if None in times or self.placement_error else max(times)

    @property
    def state_bytes(self) -> int:
        """Model + optimizer state of the whole job, DP replicas counted once (about what a
        persistent checkpoint holds; the RMSNorm weights every TP rank has are counted
        per TP rank)."""
        return sum(self.snapshot_of(p, d).state_bytes * self.par.tp
                   for p in range(self.par.pp) for d in range(self.par.dp)) \
            - self._replica_bytes()

    def _replica_bytes(self) -> int:
        """Replicated bytes counted D times above but stored once in a checkpoint."""
        return sum((self.par.dp - 1) * self.snapshot_of(p, 0).layout.replicated.nbytes
                   * self.par.tp for p in range(self.par.pp))

    def device_fits(self) -> bool:
        return max(s.device_memory for s in self.stages) <= self.hw.device_memory
