"""No pickle from the rendezvous store, no store on a non-loopback address (issue 48, item 1).

torch's c10d rendezvous reads its state from a TCPStore without login with pickle.loads:
another local user (here a real second uid, ``setpriv --reuid``) who read the endpoint and
the run id from an agent's /proc/<pid>/cmdline wrote a pickle there and ran code in the
job's agents. These tests repeat that attack on the ``reft`` rendezvous
(reft_ext/cluster/rendezvous.py), first on a store of their own (with torch's c10d backend
as the control: the same payload does run there, so the test could fail), then on a real
job of tools/launch_nodes.py (process-restart mode), whose stores must not answer on a
non-loopback address of this host either.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tools.launch_nodes import LaunchConfig, NodeLauncher, _descendants

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_UID = 1002
SETPRIV = shutil.which("setpriv")
as_other_user = pytest.mark.skipif(
    not (os.geteuid() == 0 and SETPRIV),
    reason="acting as another uid needs root and setpriv (util-linux)")

# the attacker: connect to the store, write the payload at the key, read it back (proof
# that it was written); the payload makes a directory (the marker) when unpickled
ATTACK = r"""
import base64, os, pickle, sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, key, marker = sys.argv[1:5]
class Payload:
    def __reduce__(self):
        return (os.mkdir, (marker,))
value = base64.b64encode(pickle.dumps(Payload()))
store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=20))
store.set(key, value)
print("read back:", store.get(key) == value, flush=True)
"""


def attack(host: str, port: int, key: str, marker: str) -> str:
    """The payload written into ``key`` as uid OTHER_UID; returns what it printed."""
    r = subprocess.run([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                        "--clear-groups", sys.executable, "-c", ATTACK, host, str(port), key,
                        marker],
                       capture_output=True, text=True, timeout=120, cwd="/",
                       env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read back: True" in r.stdout, r.stdout  # the payload really is in the store
    return r.stdout


@pytest.fixture
def marker_dir():
    d = tempfile.mkdtemp(prefix="reft-rdzv-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- the rendezvous state on a store of our own ------------------------------------------
@as_other_user
def test_a_pickle_from_another_user_is_never_unpickled(marker_dir, monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
        C10dRendezvousBackend

    from reft_ext.cluster import rendezvous
    from reft_ext.cluster.supervisor import listen

    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
    marker = os.path.join(marker_dir, "ran")
    settings = dyn.RendezvousSettings("job", 1, 1, dyn.RendezvousTimeout(),
                                      keep_alive_interval=dyn.timedelta(seconds=5),
                                      keep_alive_max_attempt=3)

    # control: torch's c10d backend runs the payload (so this attack is a real one)
    attack("127.0.0.1", store.port, "torch.rendezvous.job", marker)
    written = store.get("torch.rendezvous.job")
    try:
        dyn._BackendRendezvousStateHolder(C10dRendezvousBackend(store, "job"),
                                          settings).sync()
    except AttributeError:  # the "state" is what os.mkdir returned
        pass
    assert os.path.isdir(marker), "the control payload did not run: the test proves nothing"
    os.rmdir(marker)

    # the reft backend: the same value refused before anything of it is parsed, and one
    # that looks sealed (magic, a tag) but not with the job's secret too
    secret = os.urandom(32)
    backend = rendezvous.SignedStateBackend(C10dRendezvousBackend(store, "job"), secret,
                                            "job", "test")
    raw = base64.b64decode(written)
    for value in (written, base64.b64encode(b"RS1\0" + bytes(32) + raw)):
        store.set("torch.rendezvous.job", value)
        holder = dyn._BackendRendezvousStateHolder(backend, settings)
        with pytest.raises(RendezvousStateError, match="not signed with this job's"):
            holder.sync()
        assert not os.path.exists(marker)

    # a state sealed with the job's secret that holds more than a state: refused too
    bad = rendezvous.seal(secret, "torch.rendezvous", "job", pickle.dumps(os.mkdir))
    store.set("torch.rendezvous.job", base64.b64encode(bad))
    with pytest.raises(RendezvousStateError, match="not part of a rendezvous state"):
        dyn._BackendRendezvousStateHolder(backend, settings).sync()


def test_the_state_round_trips_and_the_launcher_refuses_torchs_backends(monkeypatch):
    """A real state (nodes, heartbeats, a deadline) passes the restricted unpickler; the
    launcher module accepts --standalone and --rdzv-backend reft only, and names a
    missing secret."""
    from datetime import datetime, timedelta, timezone

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    from reft_ext.cluster import rendezvous
    from reft_ext.cluster import torchrun as reft_torchrun

    s = dyn._RendezvousState()
    a, b = dyn._NodeDesc("127.0.1.10", 1, 0), dyn._NodeDesc("127.0.1.11", 2, 0)
    s.participants, s.wait_list, s.redundancy_list = {a: 0, b: 1}, {b}, {a}
    s.last_heartbeats = {a: datetime.now(timezone.utc)}
    s.deadline = datetime.now(timezone.utc) + timedelta(seconds=3)
    rendezvous.check_state(pickle.dumps(s))

    monkeypatch.delenv(rendezvous.ENV_SECRET, raising=False)
    args = torchrun.parse_args(["--standalone", "--nproc-per-node=2", "x.py"])
    reft_torchrun.prepare(args)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.local_addr) == \
        ("reft", "127.0.0.1:0", "127.0.0.1") and len(os.environ[rendezvous.ENV_SECRET]) == 64
    with pytest.raises(SystemExit, match="--rdzv-backend c10d: use --standalone"):
        reft_torchrun.prepare(torchrun.parse_args(["--rdzv-backend=c10d", "x.py"]))
    monkeypatch.delenv(rendezvous.ENV_SECRET)
    with pytest.raises(Exception, match="REFT_RDZV_SECRET is not set"):
        reft_torchrun.prepare(torchrun.parse_args(["--rdzv-backend=reft", "x.py"]))


# ---- a real job of tools/launch_nodes.py -------------------------------------------------
def non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback (the route's source address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return out


def test_every_store_the_launchers_start_is_bound_to_the_address_asked(monkeypatch):
    """The stores of the reft rendezvous (the endpoint's, the agents' shared one), the
    workers' rank-0 store and examples/slurm/rdzv_store.py: each listens on the address
    it is given, and answers on no other address of this host."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from reft_ext.cluster import rendezvous

    addr = non_loopback_address()
    if addr is None:
        pytest.skip("no non-loopback IPv4 address on this host to try the stores on")
    monkeypatch.setenv(rendezvous.ENV_SECRET, os.urandom(32).hex())
    params = RendezvousParameters("reft", "127.0.0.1:0", "job", 1, 1)
    endpoint = rendezvous._endpoint_store(params)
    shared = rendezvous.ReftRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
    with pytest.raises(Exception, match="not every interface"):
        rendezvous._endpoint_store(RendezvousParameters("reft", "0.0.0.0:0", "job", 1, 1))
    from reft_ext.cluster.supervisor import listen

    port = listen("127.0.0.1", 0).port  # a free port, as the agent's pick
    monkeypatch.setenv("MASTER_PORT", str(port))
    for k, v in dict(TORCHELASTIC_RUN_ID="job", MASTER_ADDR="127.0.0.1", RANK="0",
                     WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    kw = rendezvous.worker_store_kwargs(dyn_timeout())
    assert type(kw["store"]).__name__ == "SignedStore"
    slurm = subprocess.Popen([sys.executable, os.path.join(REPO, "examples/slurm/rdzv_store.py"),
                              "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                             text=True)
    try:
        line = slurm.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        slurm_port = int(line.rsplit(":", 1)[1])
        for name, p in (("endpoint", endpoint.port), ("shared", shared.port),
                        ("worker rank 0", port), ("rdzv_store.py", slurm_port)):
            with socket.socket() as c:
                assert c.connect_ex(("127.0.0.1", p)) == 0, name
            with socket.socket() as c:
                c.settimeout(2)
                assert c.connect_ex((addr, p)) != 0, f"{name}'s store answers on {addr}:{p}"
    finally:
        slurm.terminate()
        slurm.wait(30)


def dyn_timeout():
    from datetime import timedelta

    return timedelta(seconds=30)


@pytest.mark.slow
@as_other_user
def test_launch_nodes_job_refuses_the_pickle_and_listens_on_loopback_only(marker_dir,
                                                                          tmp_path):
    cfg = LaunchConfig(nnodes=1, nproc_per_node=2, max_restarts=0,
                       log_dir=str(tmp_path / "logs"))
    job = NodeLauncher(cfg, [], script="tests/workers/rdzv_worker.py",
                       env={"RDZV_WORKER_GO": os.path.join(marker_dir, "go")})
    marker = os.path.join(marker_dir, "ran")
    try:
        job.start()
        deadline = time.time() + 120
        while job.output(0).count("joined") < 2 and time.time() < deadline and job.running():
            time.sleep(0.2)
        assert job.output(0).count("joined") == 2, job.output(0)[-4000:]

        # what the attacker read: the endpoint and the run id on the agent's command line
        agent = job.procs[0].pid
        cmd = open(f"/proc/{agent}/cmdline", "rb").read().split(b"\0")
        flag = {w.split(b"=", 1)[0]: w.split(b"=", 1)[1].decode() for w in cmd if b"=" in w}
        host, port = flag[b"--rdzv-endpoint"].rsplit(":", 1)
        assert flag[b"--rdzv-backend"] == "reft"

        # every store of the job: bound to loopback, not reachable on another address
        pids = {os.getpid(), agent, *_descendants(agent)}
        socks = listening(pids)
        ports = {job.store.port} | {p for a, p in socks if a.startswith("127.1") is False}
        assert (host, int(port)) == ("127.0.0.1", job.store.port)
        assert not [s for s in socks if s[0] in ("0.0.0.0", "::")], socks
        addr = non_loopback_address()
        if addr is not None:
            for p in sorted({p for _, p in socks} | ports):
                with socket.socket() as c:
                    c.settimeout(2)
                    assert c.connect_ex((addr, p)) != 0, f"port {p} answers on {addr}"

        attack(host, int(port), f"torch.rendezvous.{flag[b'--rdzv-id']}", marker)
        time.sleep(3)  # the agent reads the state every monitor interval (0.2 s; cached 1 s)
        open(os.path.join(marker_dir, "go"), "w").close()
        codes = job.wait(timeout=180)
    finally:
        job.close()
    out = job.output(0)
    assert not os.path.exists(marker), "the payload ran in the job"
    # the job finished or refused: either way it said why, and nothing else failed
    finished = codes == {0: 0} and out.count("done") == 2
    refused = "not signed with this job's REFT_RDZV_SECRET" in out
    assert finished or refused, out[-4000:]
    if addr is None:
        pytest.skip("the job refused the pickle; no non-loopback IPv4 address here to "
                    "check the stores' binding against")
