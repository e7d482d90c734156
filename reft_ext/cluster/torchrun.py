"""torchrun with the ``reft`` rendezvous: no pickle from the store, no store on every interface.

    python -m reft_ext.cluster.torchrun --standalone --nproc-per-node 4 pretrain_llama.py ...
    python -m reft_ext.cluster.torchrun --rdzv-backend reft --rdzv-endpoint HOST:PORT ...

torchrun's flags, torchrun's agent (torch.distributed.run), with the ``reft`` rendezvous
backend registered first (reft_ext/cluster/rendezvous.py). ``--standalone`` means a
store on 127.0.0.1 (torch's listens on every interface), a fresh run id and a fresh job
secret; with several agents, give ``--rdzv-backend reft`` and the same
``REFT_RDZV_SECRET`` to every agent (the batch script makes it). Other backends are
refused: they read the rendezvous state with pickle from a store without login.

The run id of ``--standalone`` is the run's own (reft_ext/cluster/run_id.py: kept in its
--save directory), so a re-run finds the host memory the last launch left. A worker that
ends with a failure a restart cannot change (reft_ext/cluster/job_stop.py: a bad flag, a
full --save) is not restarted: the job ends with its status, the line its rank printed
being the only one. An abnormal end that leaves host memory says where it is and how it
is used or removed.
"""

from __future__ import annotations

import os
import sys

from reft_ext.cluster import job_stop, rendezvous, run_id
from reft_ext.config import _job_id_of
from reft_ext.store import paths


def prepare(args) -> None:
    """torchrun's parsed arguments, made to use the ``reft`` backend (raises SystemExit
    with one line for a backend that is not)."""
    if args.standalone:
        args.standalone = False
        args.rdzv_backend = rendezvous.BACKEND
        args.rdzv_endpoint = "127.0.0.1:0"
        args.rdzv_id, _ = run_id.for_script(list(args.training_script_args))
        args.local_addr = args.local_addr or "127.0.0.1"  # the workers' store's address
        # one agent: the secret can be this agent's own
        os.environ.setdefault(rendezvous.ENV_SECRET, os.urandom(32).hex())
    elif args.rdzv_backend != rendezvous.BACKEND:
        raise SystemExit(f"python -m reft_ext.cluster.torchrun: --rdzv-backend "
                         f"{args.rdzv_backend}: use --standalone (one host) or --rdzv-backend "
                         f"{rendezvous.BACKEND} (torch's backends unpickle the rendezvous "
                         f"state from a store without login)")
    rendezvous.job_secret()  # a missing secret is said here, before any worker starts


def _no_retry_of_repeating_failures() -> None:
    """torch's agent restarts a failed worker group while restarts are left; a worker
    that exited with a status of job_stop.WILL_REPEAT ends the agent's job instead."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "_reft", False):
        return

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and job_stop.will_repeat(
                f.exitcode for f in result.failures.values()) is not None:
            self._remaining_restarts = 0  # the same failure again at every restart
        return result

    _monitor_workers._reft = True
    LocalElasticAgent._monitor_workers = _monitor_workers


def host_memory_note(job: str, shm_dir: str | None) -> str | None:
    """The line an abnormal end leaves when this user's host memory of ``job`` is there."""
    shm_dir = shm_dir or paths.default_base_dir()
    parent = paths.job_parent(shm_dir, job)
    if paths.private_problem(parent) is not None:
        return None
    from reft_ext.cluster.leftovers import size as ram_of

    size = ram_of(parent)
    return (f"[REFT] host memory of job {job} kept: {parent} ({size / 2**20:.1f} MiB of "
            f"RAM). The same command with the same --save resumes from it; python "
            f"tools/reft_status.py --clean --job {job} --reft-shm-dir {shm_dir} removes it")


def main(argv=None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prepare(args)
    except RendezvousError as exc:
        raise SystemExit(f"python -m reft_ext.cluster.torchrun: {exc}") from None
    rendezvous.register()
    _no_retry_of_repeating_failures()
    script_args = list(args.training_script_args)
    shm_dir = run_id.script_flag(script_args, "--reft-shm-dir")
    given = run_id.script_flag(script_args, "--reft-job-id")
    job = _job_id_of(given) if given else args.rdzv_id  # as the trainer names its memory
    code = 0
    try:
        try:
            record(torchrun.run)(args)
        except ChildFailedError as exc:
            code = job_stop.will_repeat(f.exitcode for f in exc.failures.values())
            if code is None:  # torch's report of the failure (its table), as torchrun's
                code = 1
                raise
    except RendezvousError as exc:  # a refused state: one line, not torch's traceback
        raise SystemExit(f"[REFT] python -m reft_ext.cluster.torchrun: {exc}") from None
    except BaseException:
        code = 1
        raise
    finally:
        note = code and job and host_memory_note(job, shm_dir)
        if note:
            print(note, file=sys.stderr, flush=True)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
