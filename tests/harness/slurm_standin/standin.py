"""Stand-ins for Slurm's ``sbatch``, ``srun`` and ``scontrol`` that run a batch script's
body on this one host, so tests can run the example sbatch scripts unmodified.

Put this directory first on PATH. A "node" is a loopback address (``127.0.1.10``,
``127.0.1.11`` ...), used as its host name: ``scontrol show hostnames`` returns it, srun
sets it as SLURMD_NODENAME, and the scripts hand it to torchrun as ``--local-addr``. So
the scripts' own logic (rendezvous host, node names, ranks by address) runs unchanged,
and each node's agent has a distinct address, as on a cluster.

* ``sbatch [OPTIONS] SCRIPT [ARGS]``: reads the script's ``#SBATCH`` lines (until the
  first command, as Slurm does; command-line options win), prints ``Submitted batch job
  N``, runs a copy of the script (Slurm runs a spooled copy too: ``$0`` is not the
  original) in the submit directory with the job's SLURM_* variables, stdout and stderr
  to ``--output`` (``%x`` job name, ``%j`` job id, ``%N`` first node, ``%u`` user), and
  exits with the script's status, like ``sbatch --wait``. A missing output directory
  fails the job, as it does (silently) under Slurm.
* ``srun [OPTIONS] COMMAND``: inside a job only; one task per node (``--ntasks-per-node``
  per node) in its own session, with SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID /
  SLURMD_NODENAME; output relayed line by line (``--label`` prefixes the task id);
  ``--kill-on-bad-exit=1`` (or ``-K``) kills the step when a task fails, 0 lets the
  others go on; the exit status is the worst task's (128 + signal for a killed one).
  Options are taken as ``--opt=value`` or ``-X value``; ones that do not matter on one
  host (GPU and CPU binding, --no-kill, --overlap, ...) are accepted and ignored.
* ``scontrol show hostnames [LIST]``: expands a host list (default SLURM_JOB_NODELIST).

Fault injection (srun), for tests:

* ``STANDIN_KILL_NODE=NODE:REGEX`` loses node NODE when a line of its output matches
  REGEX: SIGKILL of every process of its tasks (their sessions and every descendant,
  which torchrun puts in sessions of their own), of its REFT node watcher, removal of its
  failure domain ``<STANDIN_SHM_DIR>/reft-<job>-node<NODE>`` and status OFFLINE, as
  tools/launch_nodes.py ``kill_node`` does. The REFT node index is taken to be NODE:
  true here, where node names sort like node ids and the spares come last.
* ``STANDIN_LATE_NODE=NODE:REGEX`` starts node NODE's tasks only once a line of the
  step's output matches REGEX (e.g. the first iteration: the job has formed without it),
  so that it is a hot spare waiting in the rendezvous, not one of the job's first nodes.
  Its tasks get REFT_NODE_GENERATION=1, like a replacement agent of
  tools/launch_nodes.py: an ``--inject-fault`` meant for the job's first attempt must not
  fire again on the spare that takes the lost rank (its own torchrun restart count is 0).
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIRST_ADDR = 10  # node i is 127.0.1.(10 + i): two digits, so string order = node order

# options whose value may follow as the next word (the others are flags)
VALUED = {"-A", "--account", "-J", "--job-name", "-N", "--nodes", "-n", "--ntasks",
          "-o", "--output", "-e", "--error", "-p", "--partition", "-t", "--time",
          "-q", "--qos", "-C", "--constraint", "-c", "--cpus-per-task", "-S",
          "--core-spec", "-w", "--nodelist", "-x", "--exclude", "-G", "--gpus",
          "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task", "--gpu-bind",
          "--cpu-bind", "--signal", "--mem", "--chdir", "-D", "--export", "--wait", "-W",
          "--kill-on-bad-exit", "--mail-type", "--mail-user", "--dependency", "-d"}


def log(tool: str, msg: str) -> None:
    print(f"[standin {tool}] {msg}", file=sys.stderr, flush=True)


def parse_options(words: list[str], stop_at_command: bool) -> tuple[dict, list[str]]:
    """'--a=b', '--a b' (known valued options), '-Xvalue', '-X value', flags -> (opts,
    rest). Keys are the option as written, long form preferred."""
    opts, i = {}, 0
    while i < len(words):
        w = words[i]
        if not w.startswith("-") or w == "-":
            break
        if w == "--":
            i += 1
            break
        if w.startswith("--") and "=" in w:
            k, v = w.split("=", 1)
        elif w in VALUED and i + 1 < len(words):
            k, v = w, words[i + 1]
            i += 1
        elif not w.startswith("--") and len(w) > 2 and w[:2] in VALUED:
            k, v = w[:2], w[2:]
        else:
            k, v = w, ""
        opts[k] = v
        i += 1
    if not stop_at_command and i < len(words):
        raise SystemExit(f"unexpected argument {words[i]!r}")
    return opts, words[i:]


def opt(opts: dict, *names: str, default: str | None = None) -> str | None:
    for n in names:
        if n in opts:
            return opts[n]
    return default


def hostnames(nodes: int) -> list[str]:
    if not 1 <= nodes <= 89:
        raise SystemExit(f"the stand-in runs 1..89 nodes, not {nodes}")
    return [f"127.0.1.{FIRST_ADDR + i}" for i in range(nodes)]


def compress(hosts: list[str]) -> str:
    first, last = hosts[0].rsplit(".", 1)[1], hosts[-1].rsplit(".", 1)[1]
    return hosts[0] if len(hosts) == 1 else f"127.0.1.[{first}-{last}]"


def expand(hostlist: str) -> list[str]:
    """Slurm host list -> names: 'a[1-3,7],b' -> a1 a2 a3 a7 b (zero padding kept)."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        for r in m.group(2).split(","):
            lo, _, hi = r.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{m.group(1)}{str(n).zfill(len(lo))}{m.group(3)}")
    return out


# ---- sbatch -----------------------------------------------------------------------------
def sbatch_directives(script: str) -> list[str]:
    words = []
    with open(script) as f:
        for line in f:
            s = line.strip()
            if s.startswith("#SBATCH"):
                words += shlex.split(s[len("#SBATCH"):], comments=True)
            elif s and not s.startswith("#"):
                break  # Slurm stops reading directives at the first command
    return words


def sbatch(argv: list[str]) -> int:
    cli, rest = parse_options(argv, stop_at_command=True)
    if not rest:
        raise SystemExit("usage: sbatch [OPTIONS] SCRIPT [ARGS]")
    script, args = rest[0], rest[1:]
    opts, _ = parse_options(sbatch_directives(script), stop_at_command=False)
    opts.update(cli)
    nodes = int(str(opt(opts, "--nodes", "-N", default="1")).split("-")[0])
    name = opt(opts, "--job-name", "-J", default=os.path.basename(script))
    job_id = os.environ.get("STANDIN_JOB_ID") or str(900000 + os.getpid() % 100000)
    hosts = hostnames(nodes)
    submit_dir = os.getcwd()
    fill = {"%x": name, "%j": job_id, "%N": hosts[0], "%u": getpass.getuser(), "%%": "%"}
    out = re.sub(r"%[xjNu%]", lambda m: fill[m.group(0)],
                 opt(opts, "--output", "-o", default="slurm-%j.out"))
    out = os.path.join(submit_dir, out)
    if not os.path.isdir(os.path.dirname(out)):
        log("sbatch", f"job {job_id}: the directory of --output {out} does not exist; Slurm "
                      f"would fail the job without any output")
        return 1
    spool = tempfile.mkdtemp(prefix=f"standin-spool-{job_id}-")
    copy = os.path.join(spool, "slurm_script")
    shutil.copy(script, copy)
    os.chmod(copy, 0o700)
    tpn = opt(opts, "--ntasks-per-node", default="1")
    env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME=name,
               SLURM_JOB_NODELIST=compress(hosts), SLURM_NODELIST=compress(hosts),
               SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NTASKS_PER_NODE=tpn, SLURM_NTASKS=str(nodes * int(tpn)),
               SLURM_SUBMIT_DIR=submit_dir, SLURM_SUBMIT_HOST=os.uname().nodename,
               SLURMD_NODENAME=hosts[0], SLURM_NODEID="0", SLURM_CLUSTER_NAME="standin",
               SLURM_CPUS_ON_NODE=str(os.cpu_count() or 1),
               SLURM_JOB_ACCOUNT=opt(opts, "--account", "-A", default=""),
               SLURM_JOB_PARTITION=opt(opts, "--partition", "-p", default="standin"))
    if opt(opts, "--cpus-per-task", "-c"):
        env["SLURM_CPUS_PER_TASK"] = opt(opts, "--cpus-per-task", "-c")
    print(f"Submitted batch job {job_id}", flush=True)
    try:
        with open(out, "a") as f:
            p = subprocess.Popen([copy, *args], cwd=submit_dir, env=env, stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            rc = p.wait()
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    return rc if rc >= 0 else 128 - rc


# ---- srun -------------------------------------------------------------------------------
class Step:
    """One srun job step: its tasks, their output relay and the fault hook."""

    def __init__(self, cmd: list[str], opts: dict):
        self.cmd, self.opts = cmd, opts
        job_nodes = int(os.environ.get("SLURM_NNODES", "1"))
        self.nodes = int(str(opt(opts, "--nodes", "-N", default=str(job_nodes))).split("-")[0])
        if self.nodes > job_nodes:
            raise SystemExit(f"srun: --nodes {self.nodes} > the job's {job_nodes}")
        self.tpn = int(opt(opts, "--ntasks-per-node", default="1"))
        self.hosts = expand(os.environ["SLURM_JOB_NODELIST"])[:self.nodes]
        self.kill_on_bad_exit = opt(opts, "--kill-on-bad-exit", "-K", default="0") in ("", "1")
        self.label = "--label" in opts or "-l" in opts
        self.lock = threading.Lock()
        self.tasks: list[dict] = []  # {node, local, proc, thread, out}
        self.kill_node, self.kill_rx = _node_and_regex("STANDIN_KILL_NODE")
        self.late_node, self.late_rx = _node_and_regex("STANDIN_LATE_NODE")

    def start(self, node: int, local: int) -> None:
        procid = node * self.tpn + local
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(procid),
                   SLURM_LOCALID=str(local), SLURMD_NODENAME=self.hosts[node],
                   SLURM_STEP_NUM_NODES=str(self.nodes),
                   SLURM_STEP_NUM_TASKS=str(self.nodes * self.tpn),
                   SLURM_STEP_NODELIST=compress(self.hosts), SLURM_NTASKS=str(
                       self.nodes * self.tpn), SLURM_TASKS_PER_NODE=str(self.tpn))
        if node == self.late_node:
            env["REFT_NODE_GENERATION"] = "1"
        proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        task = {"node": node, "local": local, "procid": procid, "proc": proc, "killed": False}
        task["thread"] = threading.Thread(target=self.relay, args=(task,), daemon=True)
        with self.lock:
            self.tasks.append(task)
        task["thread"].start()

    def relay(self, task: dict) -> None:
        prefix = f"{task['procid']}: ".encode() if self.label else b""
        for line in iter(task["proc"].stdout.readline, b""):
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()
            text = line.decode(errors="replace")
            if (self.kill_rx is not None and task["node"] == self.kill_node
                    and self.kill_rx.search(text)):
                self.kill_rx = None  # once per step
                threading.Thread(target=self.lose_node, args=(task["node"],)).start()
            if self.late_rx is not None and self.late_rx.search(text):
                self.late_rx = None
                self.echo(f"[standin srun] node {self.late_node} ({self.hosts[self.late_node]})"
                          f" starts now: a hot spare joining the running job")
                for local in range(self.tpn):
                    self.start(self.late_node, local)

    def lose_node(self, node: int) -> None:
        """The node is gone: every process of its tasks, its watcher, its memory."""
        from reft_ext.cluster import status
        from tools.launch_nodes import _descendants, _killpg

        from reft_ext.store import paths

        job = os.environ.get("REFT_JOB_ID") or os.environ["SLURM_JOB_ID"]  # reft_job.sh's
        shm = os.environ.get("STANDIN_SHM_DIR", "/dev/shm")
        with self.lock:
            victims = [t for t in self.tasks if t["node"] == node and t["proc"].poll() is None]
        for t in victims:
            t["killed"] = True
            inside = _descendants(t["proc"].pid)  # before the kill: ppid links vanish
            _killpg(t["proc"].pid, signal.SIGKILL)
            for pid in inside:
                _killpg(pid, signal.SIGKILL)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        status.kill_watcher(shm, job, node)
        shutil.rmtree(paths.node_dir(shm, job, node), ignore_errors=True)
        status.write(shm, job, node, status.OFFLINE, detail="node lost (srun stand-in)")
        self.echo(f"[standin srun] node {node} ({self.hosts[node]}) lost: SIGKILL of its "
                  f"{len(victims)} task(s) and their processes, {paths.node_dir(shm, job, node)} "
                  f"removed")

    def echo(self, msg: str) -> None:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()

    def run(self) -> int:
        for node in range(self.nodes):
            for local in range(self.tpn):
                if node != self.late_node:
                    self.start(node, local)
        worst, seen = 0, set()
        while True:
            with self.lock:
                pending = [t for t in self.tasks if id(t) not in seen]
            if not pending:
                break
            for t in pending:
                rc = t["proc"].wait()
                t["thread"].join()
                seen.add(id(t))
                rc = rc if rc >= 0 else 128 - rc
                worst = max(worst, rc)
                if rc and self.kill_on_bad_exit and not t["killed"]:
                    self.echo(f"[standin srun] task {t['procid']} exited with {rc}: "
                              f"--kill-on-bad-exit terminates the step")
                    with self.lock:
                        for o in self.tasks:
                            if o["proc"].poll() is None:
                                _signal_group(o["proc"].pid, signal.SIGKILL)
        return worst


def _node_and_regex(var: str) -> tuple[int | None, re.Pattern | None]:
    """'NODE:REGEX' from the environment (the regex may contain ':')."""
    value = os.environ.get(var, "")
    if not value:
        return None, None
    node, _, rx = value.partition(":")
    return int(node), re.compile(rx)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def srun(argv: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        log("srun", "no job allocation: the stand-in runs only inside sbatch")
        return 1
    opts, cmd = parse_options(argv, stop_at_command=True)
    if not cmd:
        raise SystemExit("usage: srun [OPTIONS] COMMAND [ARGS]")
    step = Step(cmd, opts)
    forwarded = []

    def forward(sig, _frame):  # srun passes SIGTERM/SIGINT on to its tasks
        forwarded.append(sig)
        for t in list(step.tasks):
            if t["proc"].poll() is None:
                _signal_group(t["proc"].pid, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return step.run()


# ---- scontrol ---------------------------------------------------------------------------
def scontrol(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "show" and argv[1] in ("hostnames", "hostname"):
        hl = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand(hl)))
        return 0
    log("scontrol", f"only 'show hostnames [LIST]' is supported, not {' '.join(argv)!r}")
    return 1


def main() -> int:
    tool = os.path.basename(sys.argv[0])
    return {"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[tool](sys.argv[1:])
