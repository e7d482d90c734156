"""torchrun with the ``reft`` rendezvous: no pickle from the store, no store on every interface.

    python -m reft_ext.cluster.torchrun --standalone --nproc-per-node 4 pretrain_llama.py ...
    python -m reft_ext.cluster.torchrun --rdzv-backend reft --rdzv-endpoint HOST:PORT ...

torchrun's flags, torchrun's agent (torch.distributed.run), with the ``reft`` rendezvous
backend registered first (reft_ext/cluster/rendezvous.py). ``--standalone`` means a
store on 127.0.0.1 (torch's listens on every interface), a fresh run id and a fresh job
secret; with several agents, give ``--rdzv-backend reft`` and the same
``REFT_RDZV_SECRET`` to every agent (the batch script makes it). Other backends are
refused: they read the rendezvous state with pickle from a store without login.
"""

from __future__ import annotations

import os
import sys
import uuid

from reft_ext.cluster import rendezvous


def prepare(args) -> None:
    """torchrun's parsed arguments, made to use the ``reft`` backend (raises SystemExit
    with one line for a backend that is not)."""
    if args.standalone:
        args.standalone = False
        args.rdzv_backend = rendezvous.BACKEND
        args.rdzv_endpoint = "127.0.0.1:0"
        args.rdzv_id = str(uuid.uuid4())
        args.local_addr = args.local_addr or "127.0.0.1"  # the workers' store's address
        # one agent: the secret can be this agent's own
        os.environ.setdefault(rendezvous.ENV_SECRET, os.urandom(32).hex())
    elif args.rdzv_backend != rendezvous.BACKEND:
        raise SystemExit(f"python -m reft_ext.cluster.torchrun: --rdzv-backend "
                         f"{args.rdzv_backend}: use --standalone (one host) or --rdzv-backend "
                         f"{rendezvous.BACKEND} (torch's backends unpickle the rendezvous "
                         f"state from a store without login)")
    rendezvous.job_secret()  # a missing secret is said here, before any worker starts


def main(argv=None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prepare(args)
    except RendezvousError as exc:
        raise SystemExit(f"python -m reft_ext.cluster.torchrun: {exc}") from None
    rendezvous.register()
    try:
        record(torchrun.run)(args)
    except RendezvousError as exc:  # a refused state: one line, not torch's traceback
        raise SystemExit(f"[REFT] python -m reft_ext.cluster.torchrun: {exc}") from None


if __name__ == "__main__":
    main()
