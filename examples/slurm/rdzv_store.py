"""The job's rendezvous store, run by the batch script (examples/slurm/reft_job.sh).

    python examples/slurm/rdzv_store.py --host NODE --port 29400 [--ready-file PATH]

torchrun's dynamic rendezvous keeps its state in a TCPStore. By default the agent on the
endpoint's host creates it, so the job's rendezvous lives and dies with that agent: if
it is lost, the surviving agents and any hot spare can never meet again. Here the store
is a process of its own on the batch host, every agent is a client (``--rdzv-conf
is_host=false``), and the store outlives any agent (tools/launch_nodes.py makes the same
choice on one host). It listens on the address the agents are given (``--host``, the
first node's: never every interface) and stops on SIGTERM/SIGINT, or when the batch script
that started it is gone. The agents' ``reft`` rendezvous (reft_ext/cluster/rendezvous.py)
seals what they keep here with the job's secret and never unpickles a value it did not
seal: a client of this store can disturb the job, not run code in it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True,
                   help="= the agents' --rdzv-endpoint host: the address to listen on")
    p.add_argument("--port", type=int, required=True,
                   help="= the agents' --rdzv-endpoint port; 0: one the kernel picks, written "
                        "to --ready-file")
    p.add_argument("--ready-file", default="",
                   help="created once the store accepts connections")
    p.add_argument("--timeout-minutes", type=int, default=60,
                   help="how long a store operation may block (torch's TCPStore timeout)")
    a = p.parse_args(argv)

    # after argparse: --help needs no torch. listen: a socket bound to --host, handed to
    # TCPStore (which alone would listen on every interface)
    from reft_ext.cluster.supervisor import listen
    from reft_ext.report.files import open_nofollow

    parent = os.getppid()
    # multi_tenant: several clients per process may share it; wait_for_workers=False: the
    # agents come and go (spares, replacements), no fixed number ever "joins"
    store = listen(a.host, a.port, multi_tenant=True, wait_for_workers=False,
                   timeout=datetime.timedelta(minutes=a.timeout_minutes))
    print(f"[rdzv-store] pid {os.getpid()}: listening on {a.host}:{store.port}", flush=True)
    if a.ready_file:
        with open_nofollow(a.ready_file) as f:  # never through a planted link
            f.write(f"{os.getpid()}\n{store.port}\n")  # the bound port last (--port 0)

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
