"""The process groups' store values signed with the job's secret (issue 48, item 4).

gloo finds its peers through the store (each rank's address under ``<prefix>/<rank>``) and
``all_gather_object`` unpickles what a peer sends: a client of the in-process supervisor's
store that rewrote those keys could stand in for a peer. reft_ext/cluster/signed_store.py
seals every value the job sets and ignores any other; the in-process ranks' process groups
(``Generation.pg_store``) and the torchrun workers' (rendezvous.worker_store_kwargs) use it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from reft_ext.cluster import inprocess, signed_store
from reft_ext.cluster.signed_store import ForgedValueError, SignedStore, seal, unseal
from reft_ext.cluster.supervisor import listen

SECRET = bytes(range(32))
OTHER_UID = 1002
SETPRIV = shutil.which("setpriv")


def test_seal_binds_the_secret_the_scope_and_the_key():
    v = seal(SECRET, "reft/ip/g1/pg", "0/1", b"addr")
    assert unseal(SECRET, "reft/ip/g1/pg", "0/1", v) == b"addr"
    assert unseal(SECRET, "reft/ip/g2/pg", "0/1", v) is None  # another generation
    assert unseal(SECRET, "reft/ip/g1/pg", "0/0", v) is None  # another key
    assert unseal(bytes(32), "reft/ip/g1/pg", "0/1", v) is None  # another job
    assert unseal(SECRET, "reft/ip/g1/pg", "0/1", v[:-1] + b"X") is None
    assert unseal(SECRET, "reft/ip/g1/pg", "0/1", b"addr") is None


def test_seal_binds_the_round_and_says_a_replay_from_another_round_once(capsys):
    """A value sealed in one round (the torchrun workers' store: the rendezvous round and
    its master address; the in-process generation) does not verify in another, and a
    store reading one says it is from another round, once per key."""
    v = seal(SECRET, "job/reft/workers", "0/1", b"addr", "round 1 127.0.0.1:10001")
    assert unseal(SECRET, "job/reft/workers", "0/1", v, "round 1 127.0.0.1:10001") == b"addr"
    for other in ("round 2 127.0.0.1:10001", "round 1 127.0.0.1:10002", ""):
        assert unseal(SECRET, "job/reft/workers", "0/1", v, other) is None
    # the round in clear cannot be rewritten: the tag covers it
    forged_round = v.replace(b"round 1", b"round 2")
    assert signed_store.opened(SECRET, "job/reft/workers", "0/1", forged_round) is None
    assert signed_store.opened(SECRET, "job/reft/workers", "0/1", v) == \
        ("round 1 127.0.0.1:10001", b"addr")

    inner = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False,
                   timeout=datetime.timedelta(seconds=1))
    store = SignedStore(inner, SECRET, "job/reft/workers", round_id="round 2 127.0.0.1:10003")
    inner.set("0/1", v)  # round 1's genuine value, replayed into round 2's store
    t = threading.Timer(0.3, store.set, ("0/1", b"round 2 addr"))
    t.start()
    assert store.get("0/1") == b"round 2 addr"
    t.join()
    inner.set("0/1", v)
    with pytest.raises(ForgedValueError, match="not signed with the job's secret for this"):
        store.get("0/1")
    said = capsys.readouterr().out
    assert said.count("store value for job/reft/workers/0/1 is from another round "
                      "(round 1 127.0.0.1:10001; this is round 2 127.0.0.1:10003") == 1, said
    assert "is not signed" not in said, said
    assert store.clone().round_id == store.round_id


def test_the_in_process_values_of_another_generation_are_said_as_a_replay(capsys):
    """The supervisor's per-generation values (JSON, signed with their generation) and the
    process groups' (bound to ``generation <g>``): one of generation 1 read in 2 is
    ignored and said as a replay, once."""
    inprocess._warned.discard(("reft/ip/assign/7", False))
    k = inprocess.key("assign", 7)
    old = inprocess.sign(SECRET, k, '{"rank": 0, "gen": 1}', 1)
    assert inprocess.verify(SECRET, k, old, 2) is None
    assert inprocess.verify(SECRET, k, old, 2) is None
    said = capsys.readouterr().out
    assert said.count(f"store value for {k} from another round (generation 1, this is 2") \
        == 1, said
    assert "unsigned/forged" not in said, said
    pg = seal(SECRET, inprocess.key("pg"), "0//cpu//0/1", b"addr", "generation 1")
    assert unseal(SECRET, inprocess.key("pg"), "0//cpu//0/1", pg, "generation 2") is None


def test_a_forged_value_is_ignored_until_the_jobs_own_arrives_or_the_timeout(capsys):
    inner = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False,
                   timeout=datetime.timedelta(seconds=1))
    store = SignedStore(inner, SECRET, "scope")
    inner.set("k", b"forged-before")  # planted before the job's own value
    t = threading.Timer(0.3, store.set, ("k", b"genuine"))
    t.start()
    assert store.get("k") == b"genuine"
    t.join()
    inner.set("k", b"forged-after")  # the job's value overwritten: never used
    t0 = time.monotonic()
    with pytest.raises(ForgedValueError, match="scope/k: only values not signed"):
        store.get("k")
    assert time.monotonic() - t0 >= 0.9
    said = capsys.readouterr().out
    assert said.count("store value for scope/k is not signed") == 1, said  # once per key
    assert store.add("n", 2) == 2 and store.check(["k"])  # counters and presence: plain


def test_a_store_handed_to_torch_and_dropped_still_serves_its_groups():
    """C++ finds a Python store's methods through its Python object: one the caller does
    not keep (init_process_group(store=gen.pg_store(...)), as the trainer passes it) must
    still serve the groups made later (gloo failed with "Not implemented" before)."""
    import gc

    torch.distributed.init_process_group(
        "gloo", store=SignedStore(torch.distributed.HashStore(), SECRET, "one"), rank=0,
        world_size=1)
    try:
        gc.collect()
        group = torch.distributed.new_group(backend="gloo",
                                            timeout=datetime.timedelta(seconds=20))
        t = torch.ones(2)
        torch.distributed.all_reduce(t, group=group)
        assert t.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()


def _rank(rank: int, env: dict, q) -> None:
    os.environ.update(env, RANK=str(rank), WORLD_SIZE="2")
    try:
        gen = inprocess.Generation(rank, 2)
        store_type = type(gen.pg_store(datetime.timedelta(seconds=30))).__name__
        # not kept by the caller, as the trainer passes it
        torch.distributed.init_process_group(
            "gloo", store=gen.pg_store(datetime.timedelta(seconds=30)), rank=rank,
            world_size=2, timeout=datetime.timedelta(seconds=30))
        # a group with a timeout of its own: gloo clones the store for it
        group = torch.distributed.new_group(backend="gloo",
                                            timeout=datetime.timedelta(seconds=20))
        got = [None, None]
        torch.distributed.all_gather_object(got, {"rank": rank}, group=group)
        torch.distributed.destroy_process_group()
        q.put((rank, store_type, got))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", repr(exc)))


FORGE = r"""
import sys
from datetime import timedelta
from torch.distributed import TCPStore
port, keys = int(sys.argv[1]), sys.argv[2:]
s = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
for k in keys:
    s.set(k, b"\x02\x00\x1f\x90\x7f\x00\x00\x01 forged peer address")
print("written:", all(s.get(k).endswith(b"forged peer address") for k in keys), flush=True)
"""


@pytest.mark.skipif(not (os.geteuid() == 0 and SETPRIV),
                    reason="acting as another uid needs root and setpriv (util-linux)")
def test_forged_pg_keys_of_another_user_are_ignored_by_the_in_process_ranks():
    """Another uid writes a forged peer address at every key gloo reads for generation 0's
    default group before the ranks start: the ranks ignore them (each rank's own value
    replaces its key) and exchange objects with each other, not with the forger."""
    store = listen("127.0.0.1", 0, multi_tenant=True, wait_for_workers=False)
    keys = [inprocess.key("g0", "pg", f"0//cpu//0/{r}") for r in range(2)]
    r = subprocess.run([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                        "--clear-groups", sys.executable, "-c", FORGE, str(store.port), *keys],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert "written: True" in r.stdout, r.stdout + r.stderr[-2000:]
    assert all(store.get(k).endswith(b"forged peer address") for k in keys)
    env = {inprocess.ENV_STORE: f"127.0.0.1:{store.port}", inprocess.ENV_SECRET: SECRET.hex(),
           inprocess.ENV_GENERATION: "0"}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, env, q)) for rank in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(r, "SignedStore", [{"rank": 0}, {"rank": 1}]) for r in range(2)], \
        results
    for k in keys:  # the ranks' own, sealed values stand in the store now
        assert unseal(SECRET, inprocess.key("pg"), k.split("/pg/", 1)[1],
                      store.get(k), "generation 0") is not None
    assert signed_store  # the module under test
