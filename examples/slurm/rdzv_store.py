"""The job's c10d rendezvous store, run by the batch script (examples/slurm/reft_job.sh).

    python examples/slurm/rdzv_store.py --port 29400 [--ready-file PATH]

torchrun's c10d rendezvous keeps its state in a TCPStore. By default the agent on the
endpoint's host creates it, so the job's rendezvous lives and dies with that agent: if
it is lost, the surviving agents and any hot spare can never meet again. Here the store
is a process of its own on the batch host, every agent is a client (``--rdzv-conf
is_host=false``), and the store outlives any agent (tools/launch_nodes.py makes the same
choice on one host). It listens on every interface and stops on SIGTERM/SIGINT, or when
the batch script that started it is gone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="= the agents' --rdzv-endpoint port")
    p.add_argument("--ready-file", default="",
                   help="created once the store accepts connections")
    p.add_argument("--timeout-minutes", type=int, default=60,
                   help="how long a store operation may block (torch's TCPStore timeout)")
    a = p.parse_args(argv)

    from torch.distributed import TCPStore  # after argparse: --help needs no torch

    parent = os.getppid()
    # multi_tenant: several clients per process may share it; wait_for_workers=False: the
    # agents come and go (spares, replacements), no fixed number ever "joins"
    store = TCPStore("0.0.0.0", a.port, is_master=True, multi_tenant=True,
                     wait_for_workers=False,
                     timeout=datetime.timedelta(minutes=a.timeout_minutes))
    print(f"[rdzv-store] pid {os.getpid()}: listening on port {a.port}", flush=True)
    if a.ready_file:
        with open(a.ready_file, "w") as f:
            f.write(f"{os.getpid()}\n")

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stop.append("SIGINT"))
    while not stop:
        if os.getppid() != parent:  # the batch script died without stopping us
            stop.append("batch script gone")
            break
        time.sleep(1)
    del store
    print(f"[rdzv-store] stopped ({stop[0]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
