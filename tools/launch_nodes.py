"""Several torchrun agents on one host, each standing for one node (library and CLI).

Every agent is a real TorchElastic agent with its own process group (``start_new_session``),
joined through the ``reft`` rendezvous (torch's dynamic rendezvous without pickle from the
store: reft_ext/cluster/rendezvous.py) on a loopback endpoint, so a node can be killed as a
whole (SIGKILL of its process group, its shared memory removed) and replaced by a new agent for
the same slot, exactly as on a cluster. Each agent's ranks are one failure domain:
LOCAL_WORLD_SIZE = --nproc-per-node makes REFT's ``--reft-ranks-per-node`` default to it,
and the rendezvous id is TORCHELASTIC_RUN_ID, REFT's job id, on every agent.

Slot i keeps group rank i in every rendezvous round: torch assigns ranks in the sorted
order of (address, pid), so each agent gets its own loopback address ``127.0.1.(10+i)``
(``--local-addr``); a replacement agent (new pid) thus takes over its slot's ranks and its
slot's shared-memory directory ``<shm>/reft-<job>/node<i>``.

    python tools/launch_nodes.py --nnodes 2 --nproc-per-node 2 --job-id demo -- \\
        pretrain_llama.py --reft-snapshot-every 1 --reft-protect arc ...
"""

from __future__ import annotations

import argparse
import atexit
import errno
import fcntl
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # reft_ext (status files) when run as a script

from reft_ext.cluster import status as node_status  # noqa: E402
from reft_ext.cluster.rendezvous import BACKEND as RDZV_BACKEND  # noqa: E402
from reft_ext.cluster.rendezvous import ENV_SECRET as ENV_RDZV_SECRET  # noqa: E402
from reft_ext import safe_dir  # noqa: E402
from tools.launch_config import JobOutput, LaunchConfig, LaunchError  # noqa: E402,F401


# ---- ports that nobody takes between the pick and the bind ----------------------------
# torch's get_free_port() (bind port 0, close) returns a port of the ephemeral range, which
# every bind to port 0 and every outgoing connection on the host draws from too. The rank-0
# agent picks its workers' MASTER_PORT so, and its rank-0 worker binds it after its imports:
# seconds later, tens of seconds on a busy host, by when another job's listener or
# connection had sometimes taken it (EADDRINUSE: the attempt failed and was restarted).
# Outside that range only an explicit bind takes a port; an flock per port, held by the
# process that picked it, keeps launchers (and their agents) off each other's picks.
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), f"reft-ports-{os.getuid()}")
_fallback_lock_dir: str | None = None  # this process's private one, when the shared is not


def _private_lock_dir(path: str):
    """The port locks' directory, in the shared temporary directory: opened from ``/`` one
    component at a time (reft_ext/safe_dir.py), made if missing, used only if it is this
    user's (0700, not a link). One that is not (a squatter's, a link) stops nothing: this
    process's locks go to a private temporary directory (said once), where they keep its
    own picks apart, not other launchers'. Locks are opened through the held descriptor."""
    global _fallback_lock_dir
    if _fallback_lock_dir is None:
        try:
            return safe_dir.open_dir(path, create=True)
        except (safe_dir.UnsafePathError, NotADirectoryError) as exc:
            _fallback_lock_dir = tempfile.mkdtemp(prefix=f"reft-ports-{os.getuid()}-")
            atexit.register(shutil.rmtree, _fallback_lock_dir, True)
            print(f"[REFT] warning: the port-lock directory {path} "
                  f"{getattr(exc, 'reason', 'is not a directory')}: not used; this "
                  f"launcher's port locks are in {_fallback_lock_dir} instead (remove "
                  f"{path}, or set TMPDIR to a directory of your own)", file=sys.stderr,
                  flush=True)
    return safe_dir.open_dir(_fallback_lock_dir)


PORT_FLOOR = 10000                # below: well-known and registered services
TORCH_DEFAULT_PORTS = (29400, 29500)  # torchrun's static defaults: a port others bind
PORT_LOCKS_KEPT = 64  # a process's older picks have long been bound (or given up) by then
_port_locks: list[int] = []       # flock fds of the ports this process picked, oldest first


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    """Free on every address, as a TCPStore server binds it (SO_REUSEADDR, as it does)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A port that is free now and stays free until its user binds it, however long that
    takes: outside the kernel's ephemeral range, and locked against every other caller of
    this function on the host while this process lives (its last PORT_LOCKS_KEPT picks)."""
    lo, hi = _ephemeral_range()
    pool = [p for p in range(PORT_FLOOR, 65536)
            if not lo <= p <= hi and p not in TORCH_DEFAULT_PORTS]
    with _private_lock_dir(PORT_LOCK_DIR) as locks:
        return _pick(locks, pool, lo, hi)


def _pick(locks, pool: list[int], lo: int, hi: int) -> int:
    for port in random.SystemRandom().sample(pool, min(len(pool), 256)):
        fd = locks.open(f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another launcher's pick
            os.close(fd)
            continue
        if _bindable(port):
            _port_locks.append(fd)
            while len(_port_locks) > PORT_LOCKS_KEPT:
                os.close(_port_locks.pop(0))
            return port
        os.close(fd)
    raise LaunchError(f"no free TCP port in {PORT_FLOOR}-65535 outside the ephemeral range "
                      f"{lo}-{hi} (net.ipv4.ip_local_port_range): narrow that range or "
                      f"free some ports")


def reserve_worker_ports() -> None:
    """In a torchrun agent: the workers' MASTER_PORT from free_port(), not torch's
    get_free_port() (the only port torch picks itself with TORCH_DISABLE_SHARE_RDZV_TCP_STORE;
    see above)."""
    from torch.distributed.elastic.rendezvous import api

    build = getattr(getattr(api, "RendezvousStoreInfo", None), "build", None)
    if not callable(getattr(api, "get_free_port", None)) or \
            "get_free_port" not in getattr(getattr(build, "__code__", None), "co_names", ()):
        raise LaunchError("tools/launch_nodes.py: torch.distributed.elastic.rendezvous.api"
                          ".RendezvousStoreInfo.build no longer picks MASTER_PORT with "
                          "get_free_port in this torch: update reserve_worker_ports")
    api.get_free_port = free_port


# the agent: torchrun, with the workers' port reserved and the ``reft`` rendezvous (no
# pickle from the store: reft_ext/cluster/rendezvous.py); its command line still names
# torch.distributed.run: startup_health_check and the benchmarks look for that
AGENT_MAIN = ("import sys; sys.path.insert(0, {repo!r}); import tools.launch_nodes as nodes; "
              "nodes.reserve_worker_ports(); import torch.distributed.run as run; "
              "import reft_ext.cluster.torchrun as reft_run; reft_run.main()")


class NodeLauncher(JobOutput):
    """start(), kill_node(i), replace_node(i), terminate(), wait(), output(i)."""

    def __init__(self, cfg: LaunchConfig, script_args: list[str], env: dict | None = None,
                 script: str = "pretrain_llama.py"):
        self.cfg, self.script_args, self.script = cfg, list(script_args), script
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        self.env.pop("TORCHELASTIC_RESTART_COUNT", None)
        # torchrun's --rdzv-id (= REFT's job id) in the agents' environment, not on a
        # command line every user can read: it names the job's /dev/shm parent
        self.env["PET_RDZV_ID"] = cfg.job_id
        # workers get a fresh MASTER_ADDR/PORT every round, published by that round's
        # rank 0: torch's shared agent store would keep a replaced node 0's dead port
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        # the job's rendezvous key: every agent seals and checks the rendezvous state and
        # the round's values with it (environment only: /proc/<pid>/environ is private)
        self.env[ENV_RDZV_SECRET] = os.urandom(32).hex()
        self.env.update(env or {})
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, list[str]] = {i: [] for i in range(cfg.nnodes)}
        self.returncodes: dict[int, list[int]] = {i: [] for i in range(cfg.nnodes)}
        self.store = None

    def _command(self, node: int) -> list[str]:
        c = self.cfg
        nn = f"{c.min_nodes}:{c.nnodes}" if c.min_nodes else str(c.nnodes)
        return [sys.executable, "-c", AGENT_MAIN.format(repo=REPO), f"--nnodes={nn}",
                f"--node-rank={node}", f"--nproc-per-node={c.nproc_per_node}",
                f"--rdzv-backend={RDZV_BACKEND}", f"--rdzv-endpoint=127.0.0.1:{c.port}",
                f"--rdzv-conf={self._rdzv_conf()}",  # --rdzv-id: PET_RDZV_ID (start_node)
                f"--max-restarts={c.max_restarts}",
                f"--monitor-interval={c.monitor_interval}",
                f"--local-addr={self.local_addr(node)}",
                os.path.join(REPO, self.script), *self.script_args]

    def _rdzv_conf(self) -> str:
        if not self.cfg.min_nodes:
            return "is_host=false"
        # elastic: a node that left (its agent stopped by a signal, docs/nodes.md) stays a
        # participant of the old round until its heartbeats are missing for interval x
        # attempts (5 s here, torch's default 15 s); the next round then completes
        # last_call seconds after --min-nodes joined
        return (f"is_host=false,last_call_timeout={self.cfg.last_call},"
                f"keep_alive_interval=1,keep_alive_max_attempt=5")

    @staticmethod
    def local_addr(node: int) -> str:
        # two digits for every slot: string order = slot order = group rank
        return f"127.0.1.{10 + node}"

    # ---- life cycle -------------------------------------------------------------
    def start(self) -> "NodeLauncher":
        # the rendezvous store lives here, not in an agent: any node may die and its
        # replacement must still find the job (a dedicated rendezvous host, as etcd is)
        from reft_ext.cluster.supervisor import listen

        # bound here, not picked earlier and bound later (see free_port); on loopback
        # only (TCPStore alone listens on every interface: supervisor.listen). The agents'
        # ``reft`` rendezvous seals what they keep in it with the job's secret and parses
        # the state only as the state's own types: a local client can disturb, not steer.
        self.store = listen("127.0.0.1", self.cfg.port, multi_tenant=True,
                            wait_for_workers=False)
        self.cfg.port = self.store.port
        for i in range(self.cfg.nnodes):
            self.start_node(i)
        return self

    def start_node(self, node: int) -> subprocess.Popen:
        if node in self.procs and self.procs[node].poll() is None:
            raise LaunchError(f"node {node}: its agent (pid {self.procs[node].pid}) is running")
        log = os.path.join(self.cfg.log_dir, f"node{node}.{len(self.logs[node])}.log")
        try:  # through the checked directory, never through a planted link
            fd = safe_dir.open_file(log)
        except OSError as exc:
            why = getattr(exc, "reason", None) or (
                "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror)
            raise LaunchError(f"--log-dir: {log} {why}: not written; remove it or give "
                              f"another --log-dir") from None
        self.logs[node].append(log)
        with open(fd, "w") as f:  # the agent keeps its own handle
            # generation: a fault injected for attempt k fires once job-wide (see
            # reft_ext/testing/fault_specs.attempt); REFT_MIN_NODES: the workers'
            # --reft-min-nodes default (torchrun does not tell them MIN)
            env = dict(self.env, REFT_NODE_SLOT=str(node),
                       REFT_MIN_NODES=str(self.cfg.min_nodes),
                       REFT_NODE_GENERATION=str(len(self.logs[node]) - 1))
            self.procs[node] = subprocess.Popen(
                self._command(node), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True)
        return self.procs[node]

    def kill_node(self, node: int, wipe: bool = True) -> None:
        """The node is gone: its agent and workers (one process group) SIGKILLed, its
        watcher too (a node's processes die with it), its shared memory removed."""
        p = self.procs.get(node)
        if p is not None and p.poll() is None:
            # torchrun starts each worker in a session of its own: killing the agent's
            # group alone would leave the workers running (or frozen) as orphans
            workers = _descendants(p.pid)
            _killpg(p.pid, signal.SIGKILL)
            for w in workers:
                _killpg(w, signal.SIGKILL)
            p.wait()
            self.returncodes[node].append(p.returncode)
        node_status.kill_watcher(self.cfg.shm_dir, self.cfg.job_id, node)
        if wipe:
            shutil.rmtree(self.shm_dir_of(node), ignore_errors=True)
        node_status.write(self.cfg.shm_dir, self.cfg.job_id, node, node_status.OFFLINE,
                          detail="node killed by the launcher")

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def replace_node(self, node: int) -> subprocess.Popen:
        """A new agent (empty memory if the node was wiped) for the same slot."""
        return self.start_node(node)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60) -> dict[int, int]:
        """Preemption: signal every agent (torchrun forwards it to its workers), wait for
        them and for the nodes' watchers (which flush the snapshots on worker death)."""
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, sig)
        codes = self.wait(timeout)
        # the job's exit status says preempted only once the flush is done (job_exit)
        self.flushed = node_status.wait_watchers(self.cfg.shm_dir, self.cfg.job_id, timeout)
        return codes

    def wait(self, timeout: float = 300) -> dict[int, int]:
        """Wait for every running agent; on timeout kill them all and raise."""
        deadline = time.time() + timeout
        for node, p in list(self.procs.items()):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.close()
                raise TimeoutError(f"agents still running after {timeout} s; node {node} "
                                   f"log:\n{self.output(node)[-4000:]}") from None
            self.returncodes[node].append(p.returncode)
        return {n: p.returncode for n, p in self.procs.items()}

    def close(self) -> None:
        """Nothing started here outlives the launcher (agents, workers, watchers)."""
        for node, p in self.procs.items():
            if p.poll() is None:
                workers = _descendants(p.pid)  # own sessions: see kill_node
                _killpg(p.pid, signal.SIGKILL)
                for w in workers:
                    _killpg(w, signal.SIGKILL)
                p.wait()
            node_status.kill_watcher(self.cfg.shm_dir, self.cfg.job_id, node)

    # ---- output -----------------------------------------------------------------
    def output(self, node: int) -> str:
        """Everything node's agents printed, start after start."""
        parts = []
        for path in self.logs[node]:
            with open(path, errors="replace") as f:
                parts.append(f.read())
        return "".join(parts)



def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc: ppid links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] -- SCRIPT [SCRIPT ARGS]")
    for name, f in LaunchConfig.__dataclass_fields__.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f.metadata.get("help"))
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    opts = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not rest:
        p.error("give the training script after '--'")
    if not opts.job_id:  # the run's own id, kept in its --save (reft_ext/cluster/run_id.py)
        from reft_ext.cluster import run_id

        opts.job_id = run_id.for_script(rest[1:])[0]
    try:
        cfg = LaunchConfig(**vars(opts))
    except LaunchError as exc:
        p.error(str(exc))
    if cfg.restart == "in-process":
        from tools.inprocess_launcher import InProcessLauncher

        launcher = InProcessLauncher(cfg, rest[1:], script=rest[0])
    else:
        launcher = NodeLauncher(cfg, rest[1:], script=rest[0])
    stop = []
    # preemption of the launcher = preemption of every node
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    launcher.start()  # binds the rendezvous port (--port 0: the kernel's choice)
    what = "agents" if cfg.restart == "process" else "nodes (in-process restart)"
    print(f"job {cfg.job_id}: {cfg.nnodes} {what} x {cfg.nproc_per_node} ranks, "
          f"logs in {cfg.log_dir}", flush=True)
    follower = None
    if cfg.restart == "in-process":  # the ranks' logs on the terminal, as torchrun shows them
        from tools.log_follow import LogFollower

        follower = LogFollower(lambda: launcher.sup.logs).start()
    try:
        while not stop and launcher.running():
            time.sleep(0.2)
        codes = launcher.terminate(timeout=120) if stop else launcher.wait(timeout=1e9)
    finally:
        if follower is not None:
            follower.stop()
        launcher.close()
    for n in range(cfg.nnodes):
        print(f"node {n}: exit {codes.get(n)}, logs in {cfg.log_dir}")
    code = job_exit(codes, bool(stop), getattr(launcher, "flushed", False),
                    cfg.restart == "in-process")
    print(f"job {cfg.job_id}: {EXIT_MEANING.get(code, 'failed')} (exit {code})", flush=True)
    if code:
        from reft_ext.cluster.torchrun import host_memory_note

        note = host_memory_note(cfg.job_id, cfg.shm_dir)
        if note:
            print(note, flush=True)
    return code


# The launcher's exit status, what a scheduler decides on (docs/operations.md): 0 the job
# finished; EXIT_PREEMPTED (143 = 128 + SIGTERM) stopped by SIGTERM/SIGINT with every node
# stopped and its snapshots flushed (requeue it: it resumes with nothing lost); 1 failed.
from reft_ext.cluster.supervisor import EXIT_PREEMPTED  # noqa: E402

from reft_ext.cluster.job_stop import EXIT_CHECKPOINT, EXIT_WILL_REPEAT, will_repeat  # noqa: E402

EXIT_MEANING = {0: "finished", EXIT_PREEMPTED: "preempted, snapshots flushed", 1: "failed",
                EXIT_WILL_REPEAT: "failed, not restarted (the same failure at every restart)",
                EXIT_CHECKPOINT: "failed, not restarted (a refused checkpoint)"}


def job_exit(codes: dict, stopped: bool, flushed: bool, in_process: bool) -> int:
    """The job's status from its nodes' codes. Stopped by a signal: EXIT_PREEMPTED once
    the nodes' watchers finished flushing and no rank failed on the way (the in-process
    supervisor's code says so; a torchrun agent ends with 1 after a SIGTERM whatever
    happened, so there the flush decides), else 1."""
    if not stopped:  # a failure every restart would repeat: its status (job_stop.py)
        return 0 if all(c == 0 for c in codes.values()) else \
            will_repeat(codes.values()) or 1
    if not flushed:
        return 1
    if in_process and not all(c in (0, EXIT_PREEMPTED) for c in codes.values()):
        return 1
    return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
