"""A rank of a tiny job under a torchrun agent (tests/integration/test_rendezvous_security.py):
joins the process group the trainer's way (reft_ext.cluster.rendezvous.worker_store_kwargs),
exchanges an object and a sum, says so, waits until the file $RDZV_WORKER_GO exists (the
attack's window; at most 120 s), ends. With $RDZV_WORKER_HOLD, a restarted rank (a later
round) says where its round's store is once it is up and waits for ``$RDZV_WORKER_HOLD.<rank>``
before it joins (the window for writing into the new round's store)."""

import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from reft_ext.cluster.rendezvous import worker_round, worker_store_kwargs  # noqa: E402


def wait_for(path: str) -> None:
    deadline = time.time() + 120
    while path and not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)


timeout = datetime.timedelta(seconds=60)
kwargs = worker_store_kwargs(timeout)
rank = int(os.environ["RANK"])
where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
hold = os.environ.get("RDZV_WORKER_HOLD", "")
if hold and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
    print(f"rdzv-worker rank {rank}: store up at {where} ({worker_round()})", flush=True)
    wait_for(f"{hold}.{rank}")
torch.distributed.init_process_group("gloo", timeout=timeout, **kwargs)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
got = [None] * world
torch.distributed.all_gather_object(got, rank)
assert got == list(range(world)), got
total = torch.tensor([float(rank + 1)])
torch.distributed.all_reduce(total)
assert total.item() == world * (world + 1) / 2, total
print(f"rdzv-worker rank {rank}/{world}: joined ({type(kwargs.get('store')).__name__}, "
      f"pid {os.getpid()}, store {where}, sum {total.item():g})", flush=True)
wait_for(os.environ.get("RDZV_WORKER_GO", ""))
torch.distributed.barrier()
print(f"rdzv-worker rank {rank}: done", flush=True)
torch.distributed.destroy_process_group()
