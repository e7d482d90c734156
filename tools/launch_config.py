"""What both launchers of tools/launch_nodes.py share: the job's settings
(:class:`LaunchConfig`, one ``--flag`` per field), their error, and :class:`JobOutput`.

A module of its own because launch_nodes.py picks the launcher (tools/inprocess_launcher.py
for ``--restart in-process``): the launcher it imports must not import it back.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from reft_ext import safe_dir
from reft_ext.store import paths


class LaunchError(ValueError):
    """A bad launcher setting (the message names the flag)."""



@dataclass
class LaunchConfig:
    nnodes: int = field(default=2, metadata=dict(help="node slots (agents) to start"))
    min_nodes: int = field(default=0, metadata=dict(
        help="elastic: rendezvous with --nnodes MIN:MAX (0 = fixed size)"))
    nproc_per_node: int = field(default=1, metadata=dict(help="ranks per agent (node)"))
    job_id: str = field(default="", metadata=dict(
        help="rendezvous id = TORCHELASTIC_RUN_ID = REFT job id (default: random)"))
    port: int = field(default=0, metadata=dict(help="rendezvous port (0 = a free one)"))
    max_restarts: int = field(default=3, metadata=dict(help="torchrun --max-restarts"))
    monitor_interval: float = field(default=0.2, metadata=dict(
        help="seconds between the agents' worker checks (torchrun's default is 0.1-5)"))
    shm_dir: str = field(default="/dev/shm", metadata=dict(
        help="where the nodes' REFT shared memory lives (= --reft-shm-dir)"))
    last_call: int = field(default=3, metadata=dict(
        help="elastic: seconds the rendezvous waits for more nodes once --min-nodes have "
             "joined (torchrun's last_call_timeout, 30 by default)"))
    log_dir: str = field(default="", metadata=dict(
        help="one log per agent start (default: a new temporary directory)"))
    restart: str = field(default="process", metadata=dict(
        help="process: torchrun agents restart every worker of the job on a failure | "
             "in-process: one supervisor starts the ranks, replaces only the dead ones and "
             "the survivors restart in their own processes (tools/inprocess_launcher.py)"))
    spares: int = field(default=0, metadata=dict(
        help="--restart in-process: warm workers (torch and megatron-core imported) kept "
             "ready to replace a dead rank"))

    def __post_init__(self):
        if self.nnodes < 1 or self.nnodes > 89:
            raise LaunchError(f"--nnodes: must be 1..89, got {self.nnodes}")
        if self.min_nodes < 0 or self.min_nodes > self.nnodes:
            raise LaunchError(f"--min-nodes: must be 0..{self.nnodes}, got {self.min_nodes}")
        if self.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node: must be >= 1, got {self.nproc_per_node}")
        if self.last_call < 1:
            raise LaunchError(f"--last-call: must be >= 1 second, got {self.last_call}")
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts: must be >= 0, got {self.max_restarts}")
        if self.job_id and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.job_id):
            raise LaunchError(f"--job-id: letters, digits, '.', '_', '-' only, got "
                              f"{self.job_id!r}")
        if self.restart not in ("process", "in-process"):
            raise LaunchError(f"--restart: process or in-process, got {self.restart!r}")
        if self.spares < 0 or (self.spares and self.restart != "in-process"):
            raise LaunchError(f"--spares: >= 0 and only with --restart in-process (torchrun "
                              f"starts its workers itself), got {self.spares}")
        self.job_id = self.job_id or f"nodes-{uuid.uuid4().hex[:8]}"
        # port 0: the rendezvous store binds a port of the kernel's choice at start()
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix=f"{self.job_id}-logs-")
        try:  # the logs are opened there by name: a directory no one else can write or swap
            safe_dir.open_dir(self.log_dir, create=True).close()
        except (safe_dir.UnsafePathError, NotADirectoryError) as exc:
            why = getattr(exc, "reason", "is not a directory")
            raise LaunchError(f"--log-dir: {self.log_dir} {why}: give a directory of this "
                              f"user that only this user can write (or leave --log-dir "
                              f"out: a new private one)") from None


class JobOutput:
    """What both launchers (tools/launch_nodes.py's NodeLauncher,
    tools/inprocess_launcher.py) offer alike: the job's id and memory, its output by node,
    waiting for a line, cleaning up."""

    cfg: LaunchConfig

    @property
    def job_id(self) -> str:
        return self.cfg.job_id

    def shm_dir_of(self, node: int) -> str:
        return paths.node_dir(self.cfg.shm_dir, self.cfg.job_id, node)

    def output(self, node: int) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def outputs(self) -> str:
        return "".join(self.output(n) for n in range(self.cfg.nnodes))

    def wait_for(self, pattern: str, node: int | None = None, timeout: float = 120) -> str:
        """Block until a node's output matches ``pattern`` (regex); returns the match."""
        rx, deadline = re.compile(pattern), time.time() + timeout
        while time.time() < deadline:
            for n in ([node] if node is not None else range(self.cfg.nnodes)):
                m = rx.search(self.output(n))
                if m:
                    return m.group(0)
            time.sleep(0.05)
        raise TimeoutError(f"no {pattern!r} in the output after {timeout} s:\n"
                           f"{self.outputs()[-4000:]}")

    def cleanup_shm(self) -> None:
        for d in glob.glob(paths.node_glob(self.cfg.shm_dir, self.cfg.job_id)):
            shutil.rmtree(d, ignore_errors=True) if os.path.isdir(d) else os.unlink(d)
        paths.remove_parent(self.cfg.shm_dir, self.cfg.job_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
