"""Which gloo groups connect every pair when made and which on first use
(reft_ext/cluster/groups.py ``gloo_group``): three real gloo ranks, the connections
counted from /proc. Small groups are a full mesh (the abort's socket shutdown reaches
every pair); groups beyond ``REFT_GLOO_EAGER_MAX`` connect only the pairs their
collectives use, so a job-wide group costs a rank its ring neighbours, not W-1 sockets."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from tests.harness.run import REPO

RANK = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from reft_ext.cluster.comm_abort import peer_sockets
    from reft_ext.cluster.groups import LAZY_GLOO, gloo_group

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
    t = datetime.timedelta(seconds=60)
    out = {}

    def settled(tag):  # every rank here: no connection of the last step still coming
        store.set(f"{tag}/{rank}", "1")
        store.wait([f"{tag}/{r}" for r in range(3)])
        return len(peer_sockets({port}))

    def made(name, size_env):
        if size_env is None:
            os.environ.pop("REFT_GLOO_EAGER_MAX", None)
        else:
            os.environ["REFT_GLOO_EAGER_MAX"] = size_env
        before = settled(name + "/before")
        pg = gloo_group(dist.PrefixStore(name, store), rank, 3, t)
        out[name] = {"made": settled(name + "/made") - before,
                     "env_left": LAZY_GLOO in os.environ}
        x = torch.full((4,), float(rank + 1))
        pg.allreduce([x]).wait()
        out[name]["sum"] = x.tolist()
        out[name]["used"] = settled(name + "/used") - before
        return pg

    keep = [made("eager", None), made("lazy", "2")]
    os.environ[LAZY_GLOO] = "1"  # the user's own switch: every group, whatever its size
    keep.append(made("user", None))
    out["user"]["env_kept"] = os.environ.get(LAZY_GLOO) == "1"
    settled("done")
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)
""")


@pytest.mark.timeout(120)
def test_small_groups_connect_in_full_and_large_ones_on_first_use(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    port = server.port
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    env.pop("REFT_GLOO_EAGER_MAX", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    del server
    results = []
    for r, out in enumerate(outs):
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r} said:\n{out[-3000:]}"
        results.append(json.loads(line[0][len("RESULT "):]))
    for res in results:
        for name in ("eager", "lazy", "user"):
            assert res[name]["sum"] == [6.0] * 4, (name, res)
            assert res[name]["env_left"] is (name == "user"), (name, res)
        # 3 ranks, at most EAGER_MAX (64): both peers connected as the group is made
        assert res["eager"]["made"] == 2, res
        # more than REFT_GLOO_EAGER_MAX=2: not a full mesh (a pair of another group may
        # finish connecting in the count's window: fewer than the mesh, not zero)
        assert res["lazy"]["made"] < 2 and res["lazy"]["used"] >= 1, results
        assert res["user"]["made"] < 2 and res["user"]["env_kept"], results
