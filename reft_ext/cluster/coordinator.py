"""The in-process supervisor of a job across nodes, run by the batch script (on the
first node of the allocation, beside Slurm's batch step: examples/slurm/reft_job.sh with
``RESTART=in-process``).

    python -m reft_ext.cluster.coordinator --host NODE0 --port P --nodes N \\
        --alloc-nodes M --ranks-per-node R --job-id J --log-dir DIR -- SCRIPT [ARGS...]

It hosts the job's store on NODE0's address, waits for the M node agents that srun
starts (reft_ext/cluster/node_agent.py), gives the first N nodes' warm workers the
job's ranks, and from then on runs the generation protocol of
reft_ext/cluster/supervisor.py: a failure anywhere becomes a new generation in which
the survivors keep their processes, a dead rank is replaced on its own node and a lost
node's ranks move to a spare node. Its exit status is the job's; every generation
change is one ``[inprocess]`` line and a record in ``DIR/inprocess-history.json``.

The store lives with the batch step: Slurm ends the job when that node is lost, and
the node agents then stop their workers (docs/nodes.md, "The store's node").
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # its store waits time out by design

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

from reft_ext.cluster.inprocess import ENV_SECRET, job_secret  # noqa: E402
from reft_ext.cluster.node_pool import NODE_TIMEOUT_S, NodePool  # noqa: E402
from reft_ext.cluster.supervisor import Supervisor, SupervisorConfig  # noqa: E402
from reft_ext.report.files import open_nofollow  # noqa: E402
from reft_ext import safe_dir  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True, help="the address the store listens on")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True, help="training nodes")
    p.add_argument("--alloc-nodes", type=int, required=True,
                   help="nodes of the allocation (training + spare nodes)")
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--spares-per-node", type=int, default=1,
                   help="warm workers each training node keeps for a crashed rank")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--abort-timeout", type=float, default=30.0)
    p.add_argument("--node-timeout", type=float, default=NODE_TIMEOUT_S)
    p.add_argument("--job-id", default=os.environ.get("REFT_JOB_ID", ""),
                   help="REFT's job id (default: $REFT_JOB_ID, which reft_job.sh sets with a "
                        "secret part: a command line is every user's to read)")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--ready-file", default="", help="created once the store listens")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not a.job_id:
        p.error("--job-id (or REFT_JOB_ID in the environment) is required")
    if not rest:
        p.error("give the training script after '--'")
    job_secret()  # refuses a missing or short secret before anything starts
    cfg = SupervisorConfig(world_size=a.nodes * a.ranks_per_node,
                           ranks_per_node=a.ranks_per_node, script=rest[0],
                           script_args=rest[1:], job_id=a.job_id, log_dir=a.log_dir,
                           spares=a.spares_per_node, max_restarts=a.max_restarts,
                           abort_timeout=a.abort_timeout)
    pool = NodePool(a.nodes, a.alloc_nodes, a.ranks_per_node, a.spares_per_node,
                    node_timeout=a.node_timeout)
    sup = Supervisor(cfg, pool=pool, secret_hex=os.environ[ENV_SECRET])

    def ready() -> None:
        if a.ready_file:
            with open_nofollow(a.ready_file) as f:  # never through a planted link
                f.write(f"{sup.port}\n")  # the bound one (--port 0: the kernel's choice)
        pool.say(f"store listening on {a.host}:{sup.port}; waiting for {a.alloc_nodes} "
                 f"node agent(s) ({a.nodes} training x {a.ranks_per_node} ranks)")

    def stop(signum, frame) -> None:  # a time limit: no new generation from now on
        pool.say("SIGTERM: no further generation; the ranks save and exit")
        sup.max_restarts_reached()

    signal.signal(signal.SIGTERM, stop)
    try:
        sup.start(host=socket.gethostbyname(a.host), port=a.port, on_listen=ready)
        code = sup.wait(timeout=None)
    except Exception as exc:  # noqa: BLE001 - said in one line, the job's status is 1
        sup.failure, code = f"{type(exc).__name__}: {exc}", 1
    finally:
        sup.close()
        with open(safe_dir.open_file(os.path.join(a.log_dir, "inprocess-history.json")),
                  "w") as f:
            json.dump(sup.history, f, indent=1)
    pool.say(f"job {a.job_id}: exit {code} after {len(sup.history)} restart(s)" +
             (f" ({sup.failure})" if sup.failure else ""))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
