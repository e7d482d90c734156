"""No store value replayed from an earlier round (issue 60, item 1).

Under tools/launch_nodes.py (process restart) and Slurm ``RESTART=torchrun``
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the workers' rank-0 store is new each round, but
its values were sealed for the same scope in every round: another local user listed a
round's sealed values (gloo's peer addresses), wrote them into the next round's store and
the restarted ranks connected to the old addresses. The values are now bound to the round
(reft_ext.cluster.rendezvous.worker_round): the same replay, made by a real second uid
(``setpriv``), is ignored with one line and the job completes exactly.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys

from reft_ext.cluster import signed_store
from reft_ext.cluster.rendezvous import ENV_SECRET
from tests.integration.test_rendezvous_security import OTHER_UID, SETPRIV, as_other_user
from tools.launch_nodes import LaunchConfig, NodeLauncher

# the attacker: list a store's keys and take every sealed value (what `list` prints), or
# write such values into another store and read them back (`replay`)
ATTACK = r"""
import base64, json, sys
from datetime import timedelta
from torch.distributed import TCPStore
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20),
                 wait_for_workers=False)
if mode == "list":
    got = {k: store.get(k) for k in store.list_keys()}
    print(json.dumps({k: base64.b64encode(v).decode() for k, v in got.items()
                      if v.startswith(bytes.fromhex(sys.argv[4]))}), flush=True)
else:
    values = {k: base64.b64decode(v) for k, v in json.loads(sys.stdin.read()).items()}
    for k, v in values.items():
        store.set(k, v)
    print("written:", sum(store.get(k) == v for k, v in values.items()), flush=True)
"""


def as_other(*args: str, stdin: str = "") -> str:
    r = subprocess.run([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                        "--clear-groups", sys.executable, "-c", ATTACK, *args],
                       input=stdin, capture_output=True, text=True, timeout=120, cwd="/",
                       env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@as_other_user
def test_a_previous_rounds_values_replayed_into_the_next_are_ignored(tmp_path):
    cfg = LaunchConfig(nnodes=1, nproc_per_node=2, max_restarts=1,
                       log_dir=str(tmp_path / "logs"))
    hold, go = str(tmp_path / "hold"), str(tmp_path / "go")
    job = NodeLauncher(cfg, [], script="tests/workers/rdzv_worker.py",
                       env={"RDZV_WORKER_GO": go, "RDZV_WORKER_HOLD": hold})
    secret = bytes.fromhex(job.env[ENV_SECRET])
    scope = f"{cfg.job_id}/reft/workers"
    try:
        job.start()
        # round 0: both ranks joined; uid 1002 lists the rank-0 store's sealed values
        job.wait_for(r"rank 1/2: joined .*\n", timeout=180)
        job.wait_for(r"rank 0/2: joined .*\n", timeout=60)
        first = re.search(r"rank 0/2: joined \(SignedStore, pid \d+, store ([\d.]+):(\d+)",
                          job.output(0))
        host, port0 = first.group(1), first.group(2)
        taken = json.loads(as_other("list", host, port0, signed_store.MAGIC.hex()))
        assert len(taken) >= 2, taken  # gloo's peer addresses at least
        rounds = set()
        for k, v in taken.items():  # genuine values of the job, sealed for round 0
            got = signed_store.opened(secret, scope, k.removeprefix("reft/workers/"),
                                      base64.b64decode(v))
            assert got is not None, k
            rounds.add(got[0])
        assert rounds == {f"round 0 {host}:{port0}"}, rounds

        # round 0 fails (rank 1 killed); round 1's ranks hold once their store is up
        pid1 = int(re.search(r"rank 1/2: joined \(SignedStore, pid (\d+)", job.output(0))[1])
        os.kill(pid1, signal.SIGKILL)
        job.wait_for(r"rank 1: store up at .*\n", timeout=180)
        line = job.wait_for(r"rank 0: store up at [\d.]+:\d+ \((round \d+) ", timeout=60)
        port1 = re.search(r":(\d+) \(", line)[1]
        assert "round 1 " in line, line
        # uid 1002 writes round 0's values into round 1's store: all of them are there
        said = as_other("replay", host, port1, stdin=json.dumps(taken))
        assert f"written: {len(taken)}" in said, said

        # rank 0 joins first: it reads rank 1's replayed address, ignores it, waits
        open(go, "w").close()
        open(f"{hold}.0", "w").close()
        job.wait_for(r"is from another round \(round 0 .*\n", timeout=60)
        open(f"{hold}.1", "w").close()
        codes = job.wait(timeout=180)
    finally:
        job.close()
    out = job.output(0)
    assert codes == {0: 0}, out[-4000:]
    after = out[out.index("store up at"):]
    # exact: both ranks of round 1 exchanged their own objects and summed 1 + 2
    assert after.count("sum 3)") == 2 and after.count(": done") == 2, after[-4000:]
    assert f"store {host}:{port1}, sum 3" in after, after[-4000:]
    assert "is not signed" not in out, out[-4000:]
    # said once per key, not once per look
    replays = re.findall(r"store value for (\S+) is from another round", out)
    assert replays and len(replays) == len(set(replays)), replays
