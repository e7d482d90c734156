"""The in-process supervisor's store (issue 30, finding 2): it listens on loopback only,
and a client without the job's secret can neither abort a generation nor give a warm
spare a rank, let alone an environment (LD_PRELOAD...). Real TCPStores, a real
supervisor and real worker processes (a tiny script in place of the trainer)."""

from __future__ import annotations

import datetime
import glob
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from reft_ext.cluster import inprocess
from reft_ext.cluster.inprocess import key, read_signed, set_first, sign, verify
from reft_ext.cluster.spare import parse_assignment, rank_env
from reft_ext.cluster.supervisor import Supervisor, SupervisorConfig, listen
from tests.harness.run import REPO, wait_until

SECRET = bytes(range(32))
OTHER = bytes(32)
WARN = "[REFT] warning: unsigned/forged store value for {} ignored"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    inprocess._warned.clear()
    yield
    inprocess._warned.clear()


# ---- the tags ---------------------------------------------------------------------------
def test_a_signed_value_is_accepted_for_its_key_and_generation_only(capsys):
    k = key("abort", 3)
    raw = sign(SECRET, k, "rank 1: boom", 3)
    assert verify(SECRET, k, raw, 3) == "rank 1: boom"
    assert verify(SECRET, k, raw.encode()) == "rank 1: boom"
    assert capsys.readouterr().out == ""
    assert verify(SECRET, key("abort", 4), raw) is None          # another key
    assert verify(SECRET, k, raw, 2) is None                      # another generation
    assert verify(OTHER, k, raw) is None                          # another secret
    d = json.loads(raw)
    assert verify(SECRET, k, json.dumps(dict(d, v="rank 1: other"))) is None
    assert verify(SECRET, k, json.dumps(dict(d, g=4))) is None
    for junk in ("supervisor: boom", "1", "{}", "[1, 2]", '{"g": "3", "v": "x", "t": "y"}'):
        assert verify(SECRET, key("abort", 9), junk) is None
    assert verify(SECRET, k, "") is None and verify(SECRET, k, b"") is None
    out = capsys.readouterr().out
    # one warning per key, however often it is read
    assert out.count(WARN.format(k)) == 1, out
    assert out.count(WARN.format(key("abort", 9))) == 1, out


def test_an_assignment_is_a_rank_and_a_generation_checked_by_type_and_range():
    k = key("assign", 5)

    def signed(d, g=1):
        return sign(SECRET, k, json.dumps(d), g)

    assert parse_assignment(SECRET, k, signed({"rank": 2, "gen": 1}), 4) == (2, 1)
    for bad in ({"rank": 4, "gen": 1}, {"rank": -1, "gen": 1}, {"rank": "2", "gen": 1},
                {"rank": 2.0, "gen": 1}, {"rank": True, "gen": 1}, {"rank": 2},
                {"rank": 2, "gen": 1, "env": {"LD_PRELOAD": "/tmp/evil.so"}},
                {"RANK": "2", "LD_PRELOAD": "/tmp/evil.so"}, [2, 1]):
        assert parse_assignment(SECRET, k, signed(bad), 4) is None, bad
    # signed for another generation than it names
    assert parse_assignment(SECRET, k, signed({"rank": 2, "gen": 1}, g=0), 4) is None
    # the old format (an environment), unsigned
    assert parse_assignment(SECRET, k, json.dumps({"RANK": "0", "LD_PRELOAD": "x"}), 4) is None
    env = rank_env(3, 2, 4, 2, "job", "127.0.0.1", 1234)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env[inprocess.ENV_GENERATION] == "2"
    assert env[inprocess.ENV_STORE] == "127.0.0.1:1234" and "LD_PRELOAD" not in env


# ---- the store ------------------------------------------------------------------------
def _listening(port: int) -> set[str]:
    """The local addresses listening on ``port`` (hex, as /proc/net/tcp* writes them)."""
    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    addr, p = cols[1].rsplit(":", 1)
                    if cols[3] == "0A" and int(p, 16) == port:
                        out.add(addr)
        except OSError:
            pass
    return out


def test_the_store_listens_on_loopback_only():
    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
    assert _listening(store.port) == {"0100007F"}  # 127.0.0.1, nothing else
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    client.set("a", "b")
    assert store.get("a") == b"b"


def test_first_signed_reason_wins_and_a_forged_one_is_replaced(capsys):
    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
    k = key("abort", 0)
    store.set(k, "forged: burn a restart")
    assert read_signed(store, SECRET, k, 0) is None
    assert set_first(store, SECRET, k, "supervisor: rank 1 died", 0) == "supervisor: rank 1 died"
    assert set_first(store, SECRET, k, "rank 0: restart", 0) == "supervisor: rank 1 died"
    assert read_signed(store, SECRET, k, 0) == "supervisor: rank 1 died"
    assert WARN.format(k) in capsys.readouterr().out
    # the published generation: only a value signed for itself counts
    g = key("gen")
    store.set(g, "7")
    assert inprocess.published_generation(store, SECRET) is None
    store.set(g, sign(SECRET, g, "7", 6))
    assert inprocess.published_generation(store, SECRET) is None
    store.set(g, sign(SECRET, g, "7", 7))
    assert inprocess.published_generation(store, SECRET) == 7


# ---- a real supervisor, attacked from another process ------------------------------------
_RANK = textwrap.dedent("""
    import json, os, sys, time
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "REFT_GENERATION", "LD_PRELOAD",
            "REFT_INJECTED", "MASTER_ADDR", "REFT_INPROCESS_STORE", "TORCHELASTIC_RUN_ID"]
    path = os.path.join(sys.argv[1], f"rank-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    os.replace(path + ".tmp", path)
    time.sleep(600)
""")

# a peer on the host, without the job's secret: abort the generation, publish a
# generation, give the warm spare (worker 1) an environment with LD_PRELOAD, forge
# ready/trained markers
_ATTACK = textwrap.dedent("""
    import datetime, json, sys
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
    s.compare_set("reft/ip/abort/0", "", "attacker: burn a restart")
    s.set("reft/ip/ready/0/0", "1")
    s.set("reft/ip/trained/0/0", "1")
    s.set("reft/ip/assign/1", json.dumps({
        "RANK": "0", "WORLD_SIZE": "1", "REFT_GENERATION": "0",
        "LD_PRELOAD": "/nonexistent/evil.so", "REFT_INJECTED": "1"}))
    print("attacked")
""")


def _ranks(out: str) -> list[dict]:
    found = []
    for p in sorted(glob.glob(os.path.join(out, "rank-*.json")), key=os.path.getmtime):
        with open(p) as f:
            found.append(json.load(f))
    return found


@pytest.mark.timeout(180)
def test_a_peer_without_the_secret_cannot_steer_the_job(tmp_path, capsys):
    out = tmp_path / "ranks"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    sup = Supervisor(SupervisorConfig(
        world_size=1, ranks_per_node=1, script=str(script), script_args=[str(out)],
        job_id="auth-test", log_dir=str(tmp_path / "logs"), spares=1, max_restarts=3,
        abort_timeout=1.0, preload="", env={"PYTHONPATH": REPO}, cwd=REPO))
    try:
        sup.start()
        first = wait_until(lambda: _ranks(out), 60, "rank 0 to start")
        assert first[0]["RANK"] == "0" and first[0]["REFT_GENERATION"] == "0"
        assert first[0]["LD_PRELOAD"] is None and first[0]["REFT_INJECTED"] is None
        spare_log = os.path.join(sup.cfg.log_dir, "worker1.log")

        r = subprocess.run([sys.executable, "-c", _ATTACK, str(sup.port)], cwd=REPO,
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=REPO))
        assert r.returncode == 0 and "attacked" in r.stdout, r.stderr
        # the spare sees the forged assignment (once it has imported torch) and says so
        wait_until(lambda: os.path.exists(spare_log) and
              WARN.format(key("assign", 1)) in open(spare_log).read(), 60,
              "the spare's warning")
        time.sleep(1.0)  # > abort_timeout: a generation change would be done by now
        assert sup.gen == 0 and sup.history == [] and sup.alive()
        assert len(_ranks(out)) == 1  # the spare did not start a rank
        assert sup.pool.spares and sup.pool.spares[0].poll() is None  # still waiting
        said = capsys.readouterr().out
        assert WARN.format(key("abort", 0)) in said, said

        # a real failure: the forged abort is overwritten, the spare gets a validly
        # signed assignment and builds the rank's environment itself
        sup.kill_rank(0)
        second = wait_until(lambda: _ranks(out)[1:], 60, "the replacement")[0]
        assert second["RANK"] == "0" and second["REFT_GENERATION"] == "1"
        assert second["LD_PRELOAD"] is None and second["REFT_INJECTED"] is None
        assert second["REFT_INPROCESS_STORE"] == f"127.0.0.1:{sup.port}"
        assert second["TORCHELASTIC_RUN_ID"] == "auth-test"
        assert [h["dead"] for h in sup.history] == [[0]] and sup.history[0]["warm"] == [True]
        assert read_signed(sup.store, sup.secret, key("abort", 0), 0).startswith("supervisor")

        # a correctly signed abort (what a rank of the job sends) is accepted
        set_first(sup.store, sup.secret, key("abort", 1), "rank 0: collective failed", 1)
        wait_until(lambda: sup.gen == 2, 60, "generation 2")
        third = wait_until(lambda: _ranks(out)[2:], 60, "the rank of generation 2")[0]
        assert third["REFT_GENERATION"] == "2" and third["LD_PRELOAD"] is None
        assert sup.history[1]["reason"] == "rank 0: collective failed"  # what it said
    finally:
        sup.close()


@pytest.mark.timeout(180)
def test_the_node_launchers_rendezvous_store_is_on_loopback_and_works(tmp_path):
    """tools/launch_nodes.py's store (torchrun's c10d rendezvous; torch's protocol, no
    tags possible) listens on loopback only, and two agents still rendezvous on it."""
    from tools.launch_nodes import LaunchConfig, NodeLauncher

    script = tmp_path / "hello.py"
    script.write_text("import os; print('hello from rank', os.environ['RANK'], flush=True)\n")
    cfg = LaunchConfig(nnodes=2, nproc_per_node=1, max_restarts=0,
                       log_dir=str(tmp_path / "logs"), shm_dir=str(tmp_path / "shm"))
    with NodeLauncher(cfg, [], script=str(script)) as L:
        L.start()
        assert _listening(L.store.port) == {"0100007F"}
        codes = L.wait(150)
        assert set(codes.values()) == {0}, L.outputs()
        assert "hello from rank 0" in L.outputs() and "hello from rank 1" in L.outputs()


def test_port_locks_only_in_a_private_directory(tmp_path, monkeypatch, capsys):
    """The launcher's port locks live in the shared temporary directory: a directory
    planted there (another user's and writable by others: a squatter; or a link to
    another place) is not used, nothing is created through it, and the launch goes on
    with a private temporary directory of its own (said once)."""
    from tools import launch_nodes

    def falls_back(path) -> str:
        monkeypatch.setattr(launch_nodes, "PORT_LOCK_DIR", str(path))
        monkeypatch.setattr(launch_nodes, "_fallback_lock_dir", None)
        assert launch_nodes.free_port() >= launch_nodes.PORT_FLOOR
        launch_nodes.free_port()  # the same fallback, said once
        said = capsys.readouterr().err
        assert said.count(f"port-lock directory {path} ") == 1, said
        private = launch_nodes._fallback_lock_dir
        assert os.stat(private).st_mode & 0o777 == 0o700 and not os.path.islink(private)
        assert len([n for n in os.listdir(private) if n.endswith(".lock")]) == 2
        return said

    planted = tmp_path / "ports"
    planted.mkdir()
    os.chmod(planted, 0o777)
    if os.geteuid() == 0:
        os.chown(planted, 1002, 1002)  # the squatter's
    assert "belongs to uid 1002" in falls_back(planted) or os.geteuid() != 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    falls_back(link)
    assert not list(planted.iterdir()) and not list(elsewhere.iterdir())
    # a private directory under one that others may write (no sticky bit): they could
    # swap it for theirs after the check; the walk from / refuses it by its parent
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ports").mkdir(mode=0o700)
    os.chmod(shared, 0o777)
    falls_back(shared / "ports")
    assert not list((shared / "ports").iterdir())
    own = tmp_path / "own"
    monkeypatch.setattr(launch_nodes, "PORT_LOCK_DIR", str(own))
    monkeypatch.setattr(launch_nodes, "_fallback_lock_dir", None)
    assert launch_nodes.free_port() >= launch_nodes.PORT_FLOOR
    assert os.stat(own).st_mode & 0o777 == 0o700
    assert [p.name for p in own.iterdir()][0].endswith(".lock")
    assert "port-lock directory" not in capsys.readouterr().err
