"""ReftConfig: one dataclass for REFT's snapshot/protection settings; flags are generated
from its fields with Megatron's naming (``--reft-snapshot-every`` ...; reft_ext/flags.py),
and the layout checks (parallel sizes, failure domains) live here, for the trainer's
argument parsing, the snapshotter and the planner alike."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

from reft_ext import safe_dir
from reft_ext.flags import ReftFlags

PROTECTIONS = ("none", "arc", "aec", "aor")
RESTARTS = ("in-process", "process")  # docs/nodes.md
SCHEDULES = ("has", "end-of-iteration", "host-thread")  # reft_ext/save/schedules.py (torch)


AUTO_LOCAL_NODES = 16  # --reft-keep 0 (auto): local commits for jobs of more nodes
JOB_ID_MAX = 64  # longer ids keep a prefix and a hash of the whole id (_job_id_of)
_JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _job_id_of(raw: str, limit: int = JOB_ID_MAX) -> str:
    """A job id usable in file names, distinct for distinct ids: one already made of
    ``[A-Za-z0-9._-]`` (a letter or digit first) and at most ``limit`` long is kept as it
    is; any other keeps a readable prefix (other characters made ``_``) and 15 hex digits
    of the sha256 of the whole id: ``exp/1``, ``exp 1`` and ``exp_1`` are three ids, and
    two long ids that share their beginning never share a directory. Idempotent."""
    raw = raw or ""
    if _JOB_ID_RE.fullmatch(raw) and len(raw) <= limit:
        return raw
    s = re.sub(r"[^A-Za-z0-9._-]", "_", raw).lstrip("._-") or "job"
    return s[:limit - 16] + "-" + hashlib.sha256(raw.encode()).hexdigest()[:15]


def _process_key(pid: int) -> str | None:
    """(pid, start time since boot, boot id) of a live process: names it uniquely on this
    host for as long as the host is up, whatever pid reuse does."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}:{pid}:{start}"


def default_job_id(env=None) -> tuple[str, str]:
    """(job id, where it came from) for a job started without --reft-job-id: the
    launcher's run id (TORCHELASTIC_RUN_ID: torchrun's --rdzv-id, a random one per
    --standalone launch, tools/launch_nodes.py's and the in-process launcher's job id;
    SLURM_JOB_ID), never a name every such job shares. Plain ``torchrun`` without
    --rdzv-id says ``none``: then the ranks' parent, the torchrun agent (the same for
    every rank of the node and across its restarts, a new one for every launch); a
    process started alone, itself."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID") or ""
    if run_id and run_id != "none":
        return run_id, "TORCHELASTIC_RUN_ID"
    if env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"], "SLURM_JOB_ID"
    alone = not run_id and int(env.get("WORLD_SIZE", "1") or 1) <= 1
    pid = os.getpid() if alone else os.getppid()
    key = _process_key(pid) or f"{pid}:{os.urandom(8).hex() if alone else ''}"
    name = "local" if alone else "torchrun" if run_id else "job"
    return (f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}",
            "this process" if alone else "the launching process (pid %d)" % pid)


class ReftConfigError(ValueError):
    """An invalid REFT flag or a layout the chosen protection cannot cover."""


def parse_bytes(text) -> int:
    """'512M', '8G', '1.5GiB', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.I)
    if not m:
        raise ReftConfigError(f"--reft-host-memory-limit: cannot read {text!r} as a size "
                              f"(e.g. 8G, 512M, 1073741824)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


@dataclass
class ReftConfig(ReftFlags):
    FLAG_TITLE = "REFT in-memory fault tolerance"

    snapshot_every: int = field(default=0, metadata=dict(
        help="take an in-memory snapshot every N iterations (0 = off)"))
    protect: str = field(default="none", metadata=dict(
        help="none | arc | aec, comma-combinable with aor: redundancy for the snapshots "
             "against the loss of one failure domain per sharding group"))
    shm_dir: str = field(default="/dev/shm", metadata=dict(
        help="tmpfs directory for the snapshots (one subdirectory per job and node)"))
    host_memory_limit: str = field(default="0", metadata=dict(
        help="most host memory the snapshots of one node may use, e.g. 8G (0 = the free "
             "space of --reft-shm-dir)"))
    ranks_per_node: int = field(default=0, metadata=dict(
        help="how many consecutive ranks form one failure domain (default: "
             "LOCAL_WORLD_SIZE, i.e. one node)"))
    job_id: str = field(default="", metadata=dict(
        help="names the job's shared memory, <--reft-shm-dir>/reft-<id> (default: "
             "TORCHELASTIC_RUN_ID, i.e. torchrun's --rdzv-id: under python -m "
             "reft_ext.cluster.torchrun --standalone the run's own, kept in "
             "<--save>/reft-job-id so a re-run finds its host memory; or SLURM_JOB_ID; "
             "else one of this launch's own: plain torchrun's "
             "agent, or this process); an id with other characters than [A-Za-z0-9._-] "
             "keeps a hash of itself"))
    keep: int = field(default=0, metadata=dict(
        help="snapshots each rank keeps in host memory, a ring; host memory grows with K. "
             ">= 3: each rank commits its snapshots on its own, nothing job-wide per "
             "iteration (docs/scale.md: the one-iteration skew between ranks needs the "
             "third slot); 2: each commit is an all-reduce of the whole job (which "
             "iteration a failure recovers is then independent of timing); 0 = auto: 3 "
             "above 16 nodes, else 2; more reach further back for a loss-spike rollback"))
    keep_snapshots: bool = field(default=False, metadata=dict(
        help="leave the snapshots in shared memory when training ends"))
    schedule: str = field(default="has", metadata=dict(
        help="when snapshots are copied: has (into pipeline bubbles, the rest in small "
             "chunks beside compute, finished before the next optimizer step) | "
             "end-of-iteration (blocking copy after the step) | host-thread (a background "
             "thread copies the whole snapshot at once)"))
    has_tier2: str = field(default="auto", metadata=dict(
        help="where HAS copies what the bubbles cannot hold: concurrent (beside compute, "
             "in small chunks: a GPU side stream, or spare CPU cores) | deferred (at the "
             "drain before the optimizer step) | auto (concurrent on GPU or when the node "
             "has more CPU cores than its ranks' compute threads, else deferred)"))
    device_readahead: int = field(default=16, metadata=dict(
        help="state on a GPU: the snapshot slots are page-locked and each 4 MiB unit is "
             "copied straight into its slot, this many units ahead of the one being "
             "checksummed (D2H and hashing overlap); 0 = unlocked slots, each unit "
             "through a pinned staging buffer, one at a time (no page-locked host memory)"))
    aor_verify_every: int = field(default=100, metadata=dict(
        help="with aor: every N iterations compare each host replica's checksum with its "
             "owner's optimizer shard (any --reft-snapshot-every); a mismatch is logged and "
             "the replica re-synced from its owner. A replay that cannot be bit-identical "
             "(a GPU owner, apex/TE FusedAdam) is exact at these iterations only "
             "(docs/aor.md) (0 = never)"))
    flush_dir: str = field(default="", metadata=dict(
        help="save-on-failure: when a worker dies or the job is preempted, the node's "
             "watcher copies its latest complete snapshots here; REFT-load reads them back "
             "when they are newer than host memory (default: <--save>/reft-flush when "
             "--save is set; 'none' = off)"))
    hang_timeout: float = field(default=0.0, metadata=dict(
        help="hang detection: the node's watcher SIGKILLs a rank whose heartbeat has not "
             "moved for this many seconds while computing (twice that while waiting for "
             "peers), so torchrun restarts the workers and REFT-load restores from memory "
             "instead of waiting for --distributed-timeout-minutes; armed after the first "
             "iteration, paused during checkpoint saves and validation (0 = off)"))
    restart: str = field(default="in-process", metadata=dict(
        help="after a failure: in-process (the surviving ranks abort their process "
             "groups, rendezvous again with the replacements and roll back from their own "
             "host memory without leaving their process; needs tools/launch_nodes.py "
             "--restart in-process, under torchrun it means process) | process (every "
             "worker restarts, torchrun's way)"))
    stats_interval: int = field(default=1, metadata=dict(flag="", help=(
        "every how many iterations a [REFT] snapshots line sums up the interval, with "
        "the slowest rank's times (gathered job-wide then only); the trainer sets it to "
        "--log-interval")))
    log_every_snapshot: bool = field(default=False, metadata=dict(
        help="one [REFT] snapshot line per snapshot, for debugging (default: one line "
             "per --log-interval with that interval's count, bytes and median/max ms)"))
    trace_file: str = field(default="", metadata=dict(
        help="write a Chrome trace (JSON; opens in Perfetto) of every rank's schedule, "
             "bubbles and snapshot chunks to this path"))
    calibrate_iters: int = field(default=0, metadata=dict(
        help="measure what snapshots slow training by, in the job: for N iterations "
             "(from the 5th this process trains) skip snapshots in every other block of "
             "4 and compare the median iteration times; the summary gives the figure. A "
             "failure meanwhile loses up to 4 iterations more (0 = off; "
             "benchmarks/bench_overhead.py measures it outside the job)"))

    def __post_init__(self):
        if self.aor_verify_every < 0:
            raise ReftConfigError("--reft-aor-verify-every: must be >= 0")
        if self.calibrate_iters < 0:
            raise ReftConfigError(f"--reft-calibrate-iters: must be >= 0 (0 = off), got "
                                  f"{self.calibrate_iters}")
        if self.device_readahead < 0:
            raise ReftConfigError(f"--reft-device-readahead: must be >= 0, got "
                                  f"{self.device_readahead}")
        if self.stats_interval < 1:
            raise ReftConfigError(f"--log-interval: must be >= 1, got {self.stats_interval}")
        if self.keep not in (0,) and self.keep < 2:  # (0: auto, see resolve_keep)
            raise ReftConfigError(f"--reft-keep: must be >= 2 (one committed snapshot stays "
                                  f"intact while the next is written) or 0 (auto), got "
                                  f"{self.keep}")
        if self.snapshot_every < 0:
            raise ReftConfigError(f"--reft-snapshot-every: must be >= 0, got "
                                  f"{self.snapshot_every}")
        parts = [p.strip() for p in self.protect.split(",") if p.strip()]
        bad = [p for p in parts if p not in PROTECTIONS]
        if bad or not parts:
            raise ReftConfigError(f"--reft-protect: unknown scheme(s) {bad or [self.protect]}; "
                                  f"choose from none, arc, aec (and aor)")
        if "arc" in parts and "aec" in parts:
            raise ReftConfigError("--reft-protect: arc and aec protect the same state; "
                                  "choose one of them")
        if "none" in parts and len(parts) > 1:
            raise ReftConfigError("--reft-protect: 'none' cannot be combined with "
                                  f"{[p for p in parts if p != 'none']}")
        self.protect = ",".join(parts)
        if self.has_tier2 not in ("auto", "concurrent", "deferred"):
            raise ReftConfigError(f"--reft-has-tier2: unknown value {self.has_tier2!r}; "
                                  f"choose from auto, concurrent, deferred")
        if self.restart not in RESTARTS:
            raise ReftConfigError(f"--reft-restart: unknown mode {self.restart!r}; choose "
                                  f"from {', '.join(RESTARTS)}")
        if self.schedule not in SCHEDULES:
            raise ReftConfigError(f"--reft-schedule: unknown schedule {self.schedule!r}; "
                                  f"choose from {', '.join(SCHEDULES)}")
        if self.hang_timeout < 0 or 0 < self.hang_timeout < 1:
            # the watcher polls every 0.1 s and a loaded host delays a rank by that much:
            # a shorter limit would kill healthy ranks
            raise ReftConfigError(f"--reft-hang-timeout: must be 0 (off) or at least 1 "
                                  f"second, got {self.hang_timeout:g}")
        if self.hang_timeout and not self.enabled:
            raise ReftConfigError("--reft-hang-timeout: needs --reft-snapshot-every >= 1 (the "
                                  "heartbeats are read by REFT's node watcher)")
        if self.flush_dir and os.path.isfile(self.flush_dir):
            raise ReftConfigError(f"--reft-flush-dir: {self.flush_dir!r} is a file, not a "
                                  f"directory")
        if self.flush_dir and self.flush_dir != "none" and os.path.lexists(self.flush_dir):
            # whoever else can write there (or swap it: a link, a directory above it that
            # is not safe) could forge snapshots or redirect the flush
            why = safe_dir.problem(self.flush_dir)
            if why is not None:
                raise ReftConfigError(
                    f"--reft-flush-dir: {self.flush_dir} {why}: flushed snapshots are "
                    f"neither written there nor loaded from there. Point it at a "
                    f"directory of this user that only this user can write (chmod 700)")
        self.host_memory_limit_bytes = parse_bytes(self.host_memory_limit)
        if self.ranks_per_node == 0:
            self.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.ranks_per_node < 1:
            raise ReftConfigError("--reft-ranks-per-node: must be >= 1")
        if not self.job_id:  # never one name that every job without an id shares
            self.job_id = default_job_id()[0]
        # changed to be a file name, or too long: a prefix and a hash of the whole id
        self.job_id = _job_id_of(self.job_id)

    @property
    def enabled(self) -> bool:
        return self.snapshot_every > 0

    @property
    def aor(self) -> bool:
        return "aor" in self.protect.split(",")

    @property
    def redundancy(self) -> str:
        """The parameter-state scheme: none, arc or aec."""
        for p in self.protect.split(","):
            if p in ("arc", "aec"):
                return p
        return "none"

    def resolve_keep(self, world_size: int) -> int:
        """--reft-keep 0 (auto) made concrete for a job of ``world_size`` ranks: local
        commits (3 slots) where a job-wide all-reduce per snapshot costs (more than
        AUTO_LOCAL_NODES nodes), job-wide ones (2 slots, recovery independent of
        timing) below."""
        if not self.keep:
            nodes = world_size // max(1, self.ranks_per_node)
            self.keep = 3 if nodes > AUTO_LOCAL_NODES else 2
        return self.keep

    @property
    def local_commits(self) -> bool:
        """Each rank moves its commit pointer alone (no collective): safe with a third
        slot, since no rank is ever more than one sealed snapshot ahead of another
        (reft_ext/store/commit.py says why)."""
        return self.keep >= 3

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def validate_parallel(self, world_size: int, dp_size: int,
                          distributed_optimizer: bool | None = None) -> None:
        """The layout checks that need only sizes: at argument parsing (the trainer's
        validate_args) and again, per sharding group, in :meth:`validate_layout`.
        ``distributed_optimizer`` None: not known here (not checked)."""
        if not self.enabled:
            return
        if self.redundancy != "none" and dp_size < 2:
            raise ReftConfigError(f"--reft-protect: {self.redundancy} needs data-parallel "
                                  f"size >= 2 (the layout has {dp_size}); use --reft-protect "
                                  f"none")
        if self.aor and distributed_optimizer is False:
            raise ReftConfigError(
                "--reft-protect: aor protects ZeRO-1 optimizer shards: it needs "
                "--use-distributed-optimizer (without it the optimizer state is replicated "
                "and arc/aec already cover it)")
        if self.aor and dp_size < 2:
            raise ReftConfigError(f"--reft-protect: aor needs data-parallel size >= 2 (the "
                                  f"layout has {dp_size})")
        if world_size % self.ranks_per_node:
            raise ReftConfigError(f"--reft-ranks-per-node: world size {world_size} is not a "
                                  f"multiple of {self.ranks_per_node}")

    def validate_layout(self, world_size: int, dp_groups: list[list[int]]) -> None:
        """:meth:`validate_parallel` per sharding group; where each group's redundancy
        may live is reft_ext/protect/placement.py's ``check_placement`` (which calls
        this first)."""
        self.validate_parallel(world_size, min((len(g) for g in dp_groups), default=0))

    # ---- flags (add_arguments: reft_ext/flags.py) ---------------------------------
    @classmethod
    def from_args(cls, args) -> ReftConfig:
        cfg = super().from_args(args)
        cfg.stats_interval = int(getattr(args, "log_interval", None) or 1)
        save = getattr(args, "save", None)
        if not cfg.flush_dir and save:  # save-on-failure goes next to the checkpoints
            cfg.flush_dir = os.path.join(save, "reft-flush")
        if cfg.flush_dir == "none":
            cfg.flush_dir = ""
        return cfg
