"""A real Slurm cluster of N nodes on this one machine, for trying the sbatch scripts of
examples/ and for the tests (tests/integration/test_slurm_real.py).

Debian's ``slurm-wlm`` and ``munge``: one munged, one slurmctld and N slurmd, each slurmd
a node of its own (``slurmd -N nodeK``) with its own port, spool directory and address
``127.0.1.(10+K)`` (in /etc/hosts, so that ``scontrol show hostnames`` gives names the
scripts can resolve and bind, as on a cluster). Everything else (configuration, state,
logs, munge's key and socket) lives in one private directory, so several clusters (two
test sessions) never meet::

    python tools/local_slurm.py install          # apt-get the packages (root) if absent
    python tools/local_slurm.py up DIR --nodes 3 # prints: export SLURM_CONF=DIR/slurm.conf
    SLURM_CONF=DIR/slurm.conf sbatch examples/slurm/tiny_cpu.sbatch
    python tools/local_slurm.py down DIR

Not a production configuration: no cgroups (proctrack/linuxproc, task/none), no
accounting, every daemon as root (root runs the tests on this project's CI machines).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")
HOSTS_MARK = "# reft local_slurm"


class SlurmUnavailable(RuntimeError):
    """Why no local Slurm can run here (a test skips with it)."""


def node_name(k: int) -> str:
    return f"reftnode{k}"


def node_addr(k: int) -> str:
    return f"127.0.1.{10 + k}"


def unavailable() -> str | None:
    """None when the daemons are installed and may be run, else why not."""
    missing = [d for d in DAEMONS if not shutil.which(d, path=os.environ.get("PATH", "") +
                                                      ":/usr/sbin:/sbin")]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): `make slurm` or "
                f"`python tools/local_slurm.py install` as root")
    if os.geteuid() != 0:
        return "a local Slurm runs its daemons as root (slurmd starts jobs as their user)"
    return None


def install() -> None:
    """apt-get the packages when a daemon is missing (root only; idempotent)."""
    if unavailable() is None:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("installing slurm-wlm and munge needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    get = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(get, env=env, capture_output=True).returncode == 0:
        return
    for cmd in (["apt-get", "update", "-q"], get):  # stale package lists: once more
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def _ensure_hosts(nodes: int) -> None:
    """Node names resolve to their loopback addresses (added to /etc/hosts once)."""
    with open("/etc/hosts") as f:
        text = f.read()
    add = [f"{node_addr(k)} {node_name(k)} {HOSTS_MARK}" for k in range(1, nodes + 1)
           if not any(line.split()[1:2] == [node_name(k)] for line in text.splitlines()
                      if line.strip() and not line.startswith("#"))]
    if add:
        with open("/etc/hosts", "a") as f:
            f.write(("" if text.endswith("\n") else "\n") + "\n".join(add) + "\n")


def _free_ports(n: int) -> list[int]:
    from tools.launch_nodes import free_port  # locked picks, outside the ephemeral range

    return [free_port() for _ in range(n)]


CONF = """\
ClusterName=reft{tag}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
KillWait=10
InactiveLimit=0
MinJobAge=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def env(d: str) -> dict:
    """The environment a client (sbatch, srun, squeue) of the cluster in ``d`` needs."""
    return {"SLURM_CONF": os.path.join(d, "slurm.conf"),
            "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}


def up(d: str, nodes: int = 3, timeout: float = 60) -> dict:
    """Start munged, slurmctld and ``nodes`` slurmd for a cluster in directory ``d``
    (created 0700); returns :func:`env`. Raises SlurmUnavailable with the daemons' log
    when the nodes do not come up idle."""
    why = unavailable()
    if why:
        raise SlurmUnavailable(why)
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)  # its munge key and slurm.conf steer root daemons: ours alone
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SlurmUnavailable(f"{d} is not a private directory of this user (a link, "
                               f"another user's, or open to others): use a new one")
    for sub in ("state", "log", "munge", *(f"spool/{node_name(k)}" for k in range(1, nodes + 1))):
        os.makedirs(os.path.join(d, sub), mode=0o700, exist_ok=True)
    _ensure_hosts(nodes)
    shutil.copyfile("/etc/munge/munge.key", os.path.join(d, "munge", "munge.key"))
    os.chmod(os.path.join(d, "munge", "munge.key"), 0o600)
    ports = _free_ports(nodes + 1)
    lines = [f"NodeName={node_name(k)} NodeAddr={node_addr(k)} NodeHostname=localhost "
             f"Port={ports[k]} CPUs={os.cpu_count()} State=UNKNOWN"
             for k in range(1, nodes + 1)]
    with open(os.path.join(d, "slurm.conf"), "w") as f:
        f.write(CONF.format(d=d, tag=ports[0], ctld_port=ports[0], nodes="\n".join(lines)))
    e = dict(os.environ, **env(d))
    m = os.path.join(d, "munge")
    _daemon(["munged", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key",
             f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
             f"--seed-file={m}/seed", "--force"], e)
    _daemon(["slurmctld", "-f", e["SLURM_CONF"]], e)
    for k in range(1, nodes + 1):
        _daemon(["slurmd", "-f", e["SLURM_CONF"], "-N", node_name(k)], e)
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=e, capture_output=True,
                           text=True)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        if len(states) == nodes and all(s == "idle" for s in states.values()):
            return env(d)
        time.sleep(0.5)
    logs = "".join(_tail(os.path.join(d, "log", n)) for n in sorted(os.listdir(
        os.path.join(d, "log"))))
    down(d)
    raise SlurmUnavailable(f"the local Slurm in {d} did not come up in {timeout:.0f} s "
                           f"(sinfo: {r.stdout.strip() or r.stderr.strip()}):\n{logs}")


def _daemon(cmd: list[str], e: dict) -> None:
    r = subprocess.run(cmd, env=e, capture_output=True, text=True)  # they daemonize
    if r.returncode:
        raise SlurmUnavailable(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f"--- {path}\n{f.read()[-n:]}\n"
    except OSError:
        return ""


def _pids(d: str) -> list[int]:
    out = []
    for name in sorted(os.listdir(d)) + [f"munge/{n}" for n in os.listdir(
            os.path.join(d, "munge"))] if os.path.isdir(d) else []:
        if name.endswith(".pid"):
            try:
                out.append(int(open(os.path.join(d, name)).read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
    return out


def down(d: str, timeout: float = 20) -> None:
    """Cancel every job of the cluster and stop its daemons (SIGKILL after ``timeout``)."""
    e = dict(os.environ, **env(d))
    subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=e, capture_output=True,
                   timeout=30)
    pids = _pids(d)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        _kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---- jobs and faults from outside (tests/integration/test_slurm_real.py, benchmarks) ----
def job_processes(job_id: str, node: str | None = None) -> list[int]:
    """Every process of this host whose environment says it belongs to job ``job_id``
    (and runs on Slurm node ``node``): what a node's loss takes with it."""
    marks = [f"SLURM_JOB_ID={job_id}".encode()]
    if node:
        marks.append(f"SLURMD_NODENAME={node}".encode())
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if all(m in env for m in marks):
                pids.append(int(entry))
    return pids


def lose_node(job_id: str, node: str, shm_dirs: list[str] = ()) -> list[int]:
    """Node ``node`` is gone: every process of the job on it SIGKILLed (its node agent or
    torchrun, the ranks, REFT's watcher), its shared memory (``shm_dirs``, glob patterns:
    REFT's job id under reft_job.sh has a secret part after the Slurm job id) wiped."""
    import glob

    pids = job_processes(job_id, node)
    for pid in pids:
        _kill(pid, signal.SIGKILL)
    for d in [p for pattern in shm_dirs for p in glob.glob(pattern)]:
        shutil.rmtree(d, ignore_errors=True)
    return pids


def submit(env: dict, script: str, cwd: str, options=(), faults=(), timeout: float = 300,
           out: str = "logs/%x-%j.out") -> tuple[str, int, str]:
    """Submit ``script`` with sbatch from ``cwd`` and wait for the job; ``faults``:
    (regex, action(job_id)) pairs, each run once when the job's output (``out``, with %j
    and %x filled in) first matches. Returns (job id, the job's exit code, the output's
    path); raises TimeoutError (after scancel) past ``timeout`` and AssertionError naming
    the faults never run. Not ``sbatch --wait``: it looks every 2, 3, ... 10 s, up to
    ~9 s late per job; here squeue is asked every 0.2 s."""
    import re

    r = subprocess.run(["sbatch", "--parsable", *options, script], cwd=cwd, env=env,
                       capture_output=True, text=True)
    if r.returncode or not r.stdout.strip().split(";")[0].isdigit():
        raise RuntimeError(f"sbatch refused {script}: {r.stdout}{r.stderr}")
    job_id = r.stdout.strip().split(";")[0]
    name = next((ln.split("=", 1)[1].strip() for ln in open(script)
                 if ln.startswith("#SBATCH --job-name=")), "")
    path = os.path.join(cwd, out.replace("%j", job_id).replace("%x", name))
    pending, deadline, next_q = list(faults), time.time() + timeout, 0.0
    while True:
        if time.time() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            raise TimeoutError(f"job {job_id} still running after {timeout:.0f} s")
        text = _tail(path, 10**9) if pending else ""
        for f in list(pending):
            if re.search(f[0], text):
                f[1](job_id)
                pending.remove(f)
        if time.time() >= next_q:
            next_q = time.time() + 0.2
            state = _job_state(job_id, env)
            if state is not None and state[0] not in ("PENDING", "CONFIGURING", "RUNNING",
                                                      "COMPLETING", "SUSPENDED"):
                break
        time.sleep(0.05)
    if pending:
        raise AssertionError(f"job {job_id}: faults never triggered: {[f[0] for f in pending]}")
    return job_id, state[1], path


def _job_state(job_id: str, env: dict) -> tuple[str, int] | None:
    """(state, exit code) of a job slurmctld still knows (MinJobAge), else None."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env,
                       capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
    if "JobState" not in fields:
        return None
    return fields["JobState"], int(fields.get("ExitCode", "0:0").split(":")[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="apt-get slurm-wlm and munge when absent (root)")
    u = sub.add_parser("up", help="start a cluster in DIR")
    u.add_argument("dir")
    u.add_argument("--nodes", type=int, default=3)
    sub.add_parser("down", help="stop the cluster in DIR").add_argument("dir")
    a = p.parse_args(argv)
    try:
        if a.cmd == "install":
            install()
            print("[local_slurm] slurm-wlm and munge installed")
        elif a.cmd == "up":
            e = up(os.path.abspath(a.dir), a.nodes)
            print(f"export SLURM_CONF={e['SLURM_CONF']}")
        else:
            down(os.path.abspath(a.dir))
    except SlurmUnavailable as exc:
        print(f"[local_slurm] {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
