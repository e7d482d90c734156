"""A worker process of the in-process supervisor: warm until it is given a rank.

    python -m reft_ext.cluster.spare --store HOST:PORT --id W --preload MOD[,MOD...] \\
        --world-size N --ranks-per-node P --job-id ID -- SCRIPT [ARGS...]

It imports ``--preload`` (torch, megatron-core, the trainer: the seconds a cold start
spends), calls each ``MOD:FUNC`` entry of it with the script's arguments and the world
size (``megatron.training.warm:prepare``: the tokenizer, in-memory datasets; skipped by
the job's first ranks, assigned at once), freezes the heap it made (``gc.freeze``) and
then blocks on ``reft/ip/assign/<W>`` in the supervisor's store. The
assignment is a rank and a generation, signed with the job's secret
(``$REFT_INPROCESS_SECRET``, from the worker's own launch environment) and checked by
type and range; anything else there is ignored with a warning. The worker makes the
rank's environment (RANK, WORLD_SIZE, REFT_GENERATION, ...: :func:`rank_env`) from its
own launch arguments and those two numbers, never from the store, and runs SCRIPT as
``__main__`` in this process, so a replacement rank starts with every import done. The
supervisor starts the job's first ranks the same way (assigned at once), so there is
one start-up path.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import sys
import time

ASSIGN_POLL_S = 0.05  # how often a worker looks again after a forged assignment


def rank_env(rank: int, gen: int, world_size: int, ranks_per_node: int, job_id: str,
             host: str, port: int) -> dict[str, str]:
    """The variables a rank's process is given (what torchrun would set, and the
    in-process restart's own): all of them from the launch and a validated assignment."""
    from reft_ext.cluster.inprocess import ENV_GENERATION, ENV_STORE

    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "GROUP_RANK": str(rank // ranks_per_node),
            "REFT_NODE_SLOT": str(rank // ranks_per_node),
            "MASTER_ADDR": host, "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": job_id, ENV_STORE: f"{host}:{port}",
            ENV_GENERATION: str(gen)}


def parse_assignment(secret: bytes, k: str, raw, world_size: int) -> tuple[int, int] | None:
    """(rank, generation) of a validly signed assignment, else None (and the warning
    once): exactly the two fields, ints, 0 <= rank < world_size, generation >= 0 and
    the one the tag was made for."""
    from reft_ext.cluster.inprocess import forged, verify

    value = verify(secret, k, raw)
    if value is None:
        return None
    try:
        d = json.loads(value)
    except ValueError:
        d = None
    if isinstance(d, dict) and set(d) == {"rank", "gen"}:
        rank, gen = d["rank"], d["gen"]
        if type(rank) is int and type(gen) is int and 0 <= rank < world_size and gen >= 0 \
                and verify(secret, k, raw, gen) is not None:
            return rank, gen
    forged(k)
    return None


def wait_assignment(store, secret: bytes, k: str, world_size: int) -> tuple[int, int]:
    """Block until ``k`` holds a valid assignment (a forged one is looked past)."""
    while True:
        got = parse_assignment(secret, k, store.get(k), world_size)
        if got is not None:
            return got
        time.sleep(ASSIGN_POLL_S)


def _prepare(wid: str, entry: str, func, script_args: list[str], world_size: int) -> None:
    """Call a ``--preload MOD:FUNC`` with the training script's arguments: what a rank
    of the job needs whichever rank it is, made before the survivors wait for it. A
    failure is said and left to the rank (it makes the same on its own, and reports a
    bad flag the way it always does)."""
    t0 = time.time()
    try:
        made = func(script_args, world_size)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - argparse exits on bad flags
        print(f"[inprocess] worker {wid}: {entry} failed ({type(exc).__name__}: {exc}); "
              f"the rank makes it when it is assigned", flush=True)
        return
    print(f"[inprocess] worker {wid}: prepared {made} in {time.time() - t0:.2f} s",
          flush=True)


def _die_with_parent() -> None:
    """A worker never outlives its supervisor (killed or crashed, it cannot clean up):
    the kernel SIGKILLs it when the supervisor dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the supervisor died before the prctl
            os._exit(1)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's close() is all there is


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the supervisor's store")
    p.add_argument("--id", required=True, help="this worker's id (its assignment key)")
    p.add_argument("--preload", default="", help="modules to import while waiting")
    p.add_argument("--world-size", type=int, required=True, help="the job's ranks")
    p.add_argument("--ranks-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--job-id", required=True, help="the job's run id")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not rest:
        p.error("give the training script after '--'")
    _die_with_parent()
    # the trainer's default (pretrain_llama.py), before the preload imports torch
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    t0 = time.time()
    prepares = []
    for entry in filter(None, a.preload.split(",")):
        mod, _, func = entry.partition(":")
        module = importlib.import_module(mod)
        if func:
            prepares.append((entry, getattr(module, func)))
    import datetime

    import torch

    from reft_ext.cluster.inprocess import ENV_STORE, job_secret, key

    secret = job_secret()
    # under the supervisor from now on (the flag checks of the prepare below ask)
    os.environ[ENV_STORE] = a.store
    host, port = a.store.rsplit(":", 1)
    store = torch.distributed.TCPStore(host, int(port), is_master=False,
                                       timeout=datetime.timedelta(days=7),
                                       wait_for_workers=False)
    store.set(key("warm", a.id), f"{time.time() - t0:.3f}")  # a statistic, steers nothing
    # a spare, not one of the first ranks: make what any rank needs (taken meanwhile, it
    # finishes first: the rank would make the same)
    if not store.check([key("assign", a.id)]):
        for entry, func in prepares:
            _prepare(a.id, entry, func, rest[1:], a.world_size)
    gc.freeze()  # the imports' heap: the rank's collections need not walk it
    rank, gen = wait_assignment(store, secret, key("assign", a.id), a.world_size)
    os.environ.update(rank_env(rank, gen, a.world_size, a.ranks_per_node, a.job_id,
                               host, int(port)))
    os.environ["REFT_WARM_START"] = f"{time.time():.6f}"  # when the rank's life began
    del store
    sys.argv = list(rest)
    try:
        runpy.run_path(rest[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
