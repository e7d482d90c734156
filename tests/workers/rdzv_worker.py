"""A rank of a tiny job under a torchrun agent (tests/integration/test_rendezvous_security.py):
joins the process group the trainer's way (reft_ext.cluster.rendezvous.worker_store_kwargs),
exchanges an object, says so, waits until the file $RDZV_WORKER_GO exists (the attack's
window; at most 120 s), ends."""

import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from reft_ext.cluster.rendezvous import worker_store_kwargs  # noqa: E402

timeout = datetime.timedelta(seconds=60)
kwargs = worker_store_kwargs(timeout)
torch.distributed.init_process_group("gloo", timeout=timeout, **kwargs)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
got = [None] * world
torch.distributed.all_gather_object(got, rank)
assert got == list(range(world)), got
print(f"rdzv-worker rank {rank}/{world}: joined ({type(kwargs.get('store')).__name__}, "
      f"pid {os.getpid()})", flush=True)
go, deadline = os.environ.get("RDZV_WORKER_GO", ""), time.time() + 120
while go and not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.1)
torch.distributed.barrier()
print(f"rdzv-worker rank {rank}: done", flush=True)
torch.distributed.destroy_process_group()
