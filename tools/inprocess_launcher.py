"""The in-process launcher: tools/launch_nodes.py with ``--restart in-process``.

The same node slots, logs and faults from outside as :class:`tools.launch_nodes.NodeLauncher`
(start, kill_node, wait, output, wait_for, close), but no torchrun agents: one
supervisor (reft_ext/cluster/supervisor.py) starts every rank itself, replaces a dead
rank with a warm spare (``--spares``) or a new worker, and the survivors of a failure
restart inside their own processes (reft_ext/cluster/inprocess.py, docs/nodes.md).

    python tools/launch_nodes.py --restart in-process --spares 2 --nnodes 2 \\
        --nproc-per-node 2 -- pretrain_llama.py --reft-snapshot-every 1 ...

Run as a script it is that command: ``python tools/inprocess_launcher.py --spares 2
--nnodes 2 ... -- pretrain_llama.py ...`` (the same flags, ``--restart in-process`` implied).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: tools/ is sys.path[0], not the repository
    sys.path.insert(0, REPO)

from reft_ext.cluster import status as node_status  # noqa: E402
from reft_ext.cluster.supervisor import Supervisor, SupervisorConfig  # noqa: E402
from tools.launch_config import JobOutput  # noqa: E402


def hang_timeout(script_args: list[str]) -> float:
    """The trainer's --reft-hang-timeout (its last value, as argparse takes it; 0: off),
    which the supervisor's start-up watch uses too."""
    value = 0.0
    for i, a in enumerate(script_args):
        text = a.split("=", 1)[1] if a.startswith("--reft-hang-timeout=") else \
            script_args[i + 1] if a == "--reft-hang-timeout" and i + 1 < len(script_args) \
            else None
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                pass  # the trainer refuses it with its own line
    return value


class InProcessLauncher(JobOutput):
    """start(), kill_node(i), wait(), output(i), wait_for(), close(); ``history``."""

    def __init__(self, cfg, script_args: list[str], env: dict | None = None,
                 script: str = "pretrain_llama.py"):
        self.cfg = cfg
        path = script if os.path.isabs(script) else os.path.join(REPO, script)
        run_env = {"PYTHONWARNINGS": "ignore",
                   "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get(
                       "PYTHONPATH")]))}
        run_env.update(env or {})
        self.sup = Supervisor(SupervisorConfig(
            world_size=cfg.nnodes * cfg.nproc_per_node, ranks_per_node=cfg.nproc_per_node,
            script=path, script_args=list(script_args), job_id=cfg.job_id,
            log_dir=cfg.log_dir, spares=cfg.spares, max_restarts=cfg.max_restarts,
            hang_timeout=hang_timeout(script_args), env=run_env, cwd=REPO))

    @property
    def history(self) -> list[dict]:
        return self.sup.history

    def ranks_of(self, node: int) -> list[int]:
        n = self.cfg.nproc_per_node
        return list(range(node * n, (node + 1) * n))

    # ---- life cycle -------------------------------------------------------------
    def start(self) -> "InProcessLauncher":
        self.sup.start()
        return self

    def kill_node(self, node: int, wipe: bool = True) -> None:
        """The node is gone: its ranks SIGKILLed, its watcher too, its shared memory
        removed. The supervisor replaces its ranks in the next generation."""
        for r in self.ranks_of(node):
            self.sup.kill_rank(r, signal.SIGKILL)
        node_status.kill_watcher(self.cfg.shm_dir, self.cfg.job_id, node)
        if wipe:
            shutil.rmtree(self.shm_dir_of(node), ignore_errors=True)

    def running(self) -> bool:
        return self.sup.alive()

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60) -> dict[int, int]:
        """Preemption: every rank gets ``sig`` (the trainer commits the snapshot in flight
        or saves: its exit-signal handling), the job ends without a new generation and
        the nodes' watchers flush. {node: the job's code}: EXIT_PREEMPTED once all of
        that is done, 1 where a rank failed or a flush did not end in ``timeout``."""
        self.sup.preempt(sig)
        codes = self.wait(timeout)
        self.flushed = node_status.wait_watchers(self.cfg.shm_dir, self.cfg.job_id, timeout)
        if not self.flushed:
            print(f"[launcher] preempted, but the nodes' watchers did not finish flushing "
                  f"within {timeout:.0f} s", flush=True)
            codes = {n: 1 for n in codes}
        return codes

    def wait(self, timeout: float = 300) -> dict[int, int]:
        """Wait for the job; {node: exit code} (one code: the job's)."""
        code = self.sup.wait(timeout)
        if self.sup.failure:
            print(f"[launcher] {self.sup.failure}", flush=True)
        return {n: code for n in range(self.cfg.nnodes)}

    def close(self) -> None:
        self.sup.close()
        for n in range(self.cfg.nnodes):
            node_status.kill_watcher(self.cfg.shm_dir, self.cfg.job_id, n)

    # ---- output -----------------------------------------------------------------
    def output(self, node: int) -> str:
        """Everything the node's ranks printed, worker after worker."""
        parts = []
        for r in self.ranks_of(node):
            for path in self.sup.logs[r]:
                with open(path, errors="replace") as f:
                    parts.append(f.read())
        return "".join(parts)


def main(argv=None) -> int:
    """tools/launch_nodes.py's command line with ``--restart in-process`` put first (a
    later ``--restart`` given by the caller still wins, as argparse keeps the last)."""
    import runpy  # run, not imported: launch_nodes imports this module (no import cycle)

    argv = sys.argv[1:] if argv is None else list(argv)
    sys.argv = [os.path.join(REPO, "tools", "launch_nodes.py"), "--restart", "in-process",
                *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
