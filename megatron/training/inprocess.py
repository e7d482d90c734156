"""In-process restart, the trainer's side (``--reft-restart in-process``).

The generations, the abort and the supervisor are reft_ext's
(reft_ext/cluster/inprocess.py, supervisor.py). What is Megatron's is here:

* the process groups of each generation rendezvous on that generation's store prefix
  (inprocess_generation.py, called by initialize.py: this module re-joins through
  initialize.py, so initialize.py must not import it);
* tearing down: megatron-core's parallel state and every torch process group, after
  the communicators were aborted each by its own means (NCCL: ``ProcessGroupNCCL.abort``
  and a bounded CUDA drain; gloo: socket shutdown; reft_ext/cluster/inprocess.py
  ``plan_abort``); where that abort failed this rank exits instead (a process restart);
* keeping the model chunks, the DDP buffers and bucket groups, the optimizer, the p2p
  communicator... (a new model and optimizer would be new tensors REFT must learn again)
  with the process groups they were built with. With ``reft_ext._groups`` built, the
  groups themselves persist: each is given the next generation's communicator
  (reft_ext/cluster/groups.py ``reconfigure``), so whoever holds one (a tuple, a
  closure, C++) is served. Without it (or for NCCL) the fallback is *rebinding*: every
  reference to an old group is pointed at the new group made in the same place
  (megatron-core creates its groups in a fixed order, so the i-th group of generation g
  and of g + 1 have the same ranks and role); a group still held afterwards (a tuple)
  makes the restart fail over to a process restart for this rank, with the reason logged.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import gc
import os
import sys
import time
import types

import torch
from megatron.core import parallel_state as mpu
from megatron.core.timers import Timers

from megatron.training.inprocess_generation import (all_groups, base_descriptions,
                                                   base_groups, describe, generation,
                                                   persistent, reconfigure)
from reft_ext.cluster.groups import wait_retired
from reft_ext.cluster.inprocess import RestartError

_others: list = []       # the later groups of the failed generation (none may stay held)


def trained() -> None:
    """The first iteration of this generation is done (under the supervisor)."""
    gen = generation()
    if gen is not None:
        gen.trained()


def close() -> None:
    """Training ended: stop this rank's abort watcher."""
    gen = generation()
    if gen is not None:
        gen.close()


def should_restart(args, exc: BaseException) -> bool:
    """Restart in this process? Only under the supervisor, with --reft-restart
    in-process, and for what a peer's failure looks like (a bug of this rank's own
    exits: the supervisor replaces the process)."""
    gen = generation()
    if gen is None or getattr(args, "reft_restart", "process") != "in-process":
        return False
    if not isinstance(exc, Exception) or isinstance(exc, RestartError):
        return False
    return gen.is_failure(exc)


def teardown() -> list:
    """Leave megatron-core's parallel state and destroy every process group; returns the
    old groups (for :func:`rebind`). With persistent groups only the groups made after
    start-up (the session's, the trace's...) are destroyed: their owners make them anew
    in the next generation; megatron-core's stay, to be reconfigured."""
    global _others
    old = base_groups()
    old_desc = base_descriptions()
    _others = [g for g in all_groups() if g not in old]  # the session's, the trace's...
    if persistent():
        for pg in _others:
            with contextlib.suppress(Exception):  # a failed generation's group
                torch.distributed.destroy_process_group(pg)
        _others = []
        return []
    try:
        mpu.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - groups of a failed generation may not destroy
        pass
    if torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return list(zip(old, old_desc))


def rebind(old_groups: list, new: list, roots: list) -> int:
    """Point every reference to ``old[i]`` reachable from ``roots`` at ``new[i]``;
    returns how many were changed. Raises RestartError if an old group is held where it
    cannot be replaced (a tuple, a frozenset), or the generations' groups differ."""
    global _released
    old = [g for g, _ in old_groups]
    old_ranks = [d[1:] for _, d in old_groups]
    new_ranks = [d[1:] for d in describe(new)]
    if old_ranks != new_ranks:
        raise RestartError(f"this generation made other process groups than the last "
                           f"({len(new_ranks)} vs {len(old_ranks)}; ranks {new_ranks} vs "
                           f"{old_ranks})")
    held, stuck = _walk(roots, {id(o): n for o, n in zip(old, new)})
    if stuck:
        raise RestartError(f"old process groups held where they cannot be replaced: "
                           f"{sorted(set(stuck))}")
    _released = old + _others
    _others.clear()
    return len(held)


_LEAVES = (torch.Tensor, str, bytes, int, float, bool, complex, type(None), type,
           types.ModuleType, types.BuiltinFunctionType, types.CodeType)


def _walk(roots: list, mapping: dict) -> tuple[list, list]:
    """(holders replaced in, holders that cannot be: tuples...) of the objects. Replace, in every container and object reachable from ``roots``, the values whose
    id is in ``mapping``. gc.get_referrers cannot do this: a dict holding only process
    groups (pybind objects, not GC-tracked) is itself untracked and never reported."""
    seen, stack, held, stuck = set(), list(roots), [], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES) or id(obj) in mapping:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict) or isinstance(getattr(obj, "__dict__", None), dict):
            d = obj if isinstance(obj, dict) else vars(obj)
            for k, v in list(d.items()):
                if id(v) in mapping:
                    d[k] = mapping[id(v)]
                    held.append(type(obj).__name__)
                else:
                    stack.append(v)
            if d is obj:
                continue
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                if id(v) in mapping:
                    obj[i] = mapping[id(v)]
                    held.append(type(obj).__name__)
                else:
                    stack.append(v)
        elif isinstance(obj, (tuple, set, frozenset)):
            if any(id(v) in mapping for v in obj):
                stuck.append(type(obj).__name__)
            stack.extend(obj)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if id(v) in mapping:
                    cell.cell_contents = mapping[id(v)]
                    held.append(type(obj).__name__)
                else:
                    stack.append(v)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, obj.args, obj.keywords))
        for name in _slots(type(obj)):
            v = getattr(obj, name, None)
            if id(v) in mapping:
                setattr(obj, name, mapping[id(v)])
                held.append(type(obj).__name__)
            elif v is not None:
                stack.append(v)
    return held, stuck


def _slots(cls) -> list[str]:
    return [n for c in cls.__mro__ for n in getattr(c, "__slots__", ())
            if isinstance(n, str) and n not in ("__dict__", "__weakref__")]


_released: list = []  # the failed generation's groups, dropped once the restart is done


def check_released(roots: list) -> None:
    """After the restart: nothing reachable may still hold a group of the failed
    generation (a collective on it would fail; its sockets and buffers would leak).
    The same walk as :func:`rebind`, each group mapped to itself: whoever it would
    replace in holds one."""
    groups = list(_released)
    _released.clear()
    held, stuck = _walk(roots, {id(g): g for g in groups})
    if held or stuck:
        raise RestartError(f"process groups of the failed generation still held by "
                           f"{sorted(set(held + stuck))}")


def roots(trainer) -> list:
    """Where process groups can be held: the trainer (model, optimizer, config, the
    schedule's communicator, REFT's session...) and megatron's module globals."""
    mods = [vars(m) for name, m in list(sys.modules.items())
            if m is not None and name.split(".")[0] == "megatron"]
    return [trainer, *mods]


# ---- the collectives of building the model and optimizer ----------------------------------
# megatron-core's optimizer builder agrees on parameter groups job-wide (all_gather_object
# over the world, core/optimizer/__init__.py _get_param_groups). A replacement process
# makes those calls; a survivor, which keeps its optimizer, makes the same calls with the
# same objects again (recorded at its own build), so both meet in the same collectives.
_build_calls: list[tuple[object, int | None]] = []


@contextlib.contextmanager
def recording_build():
    """Record the all_gather_object calls made while building the model and optimizer."""
    orig = torch.distributed.all_gather_object

    def recorded(object_list, obj, group=None):
        index = None if group is None else all_groups().index(group)
        _build_calls.append((copy.deepcopy(obj), index))
        return orig(object_list, obj, group=group)

    torch.distributed.all_gather_object = recorded
    try:
        yield
    finally:
        torch.distributed.all_gather_object = orig


def replay_build() -> None:
    """A survivor's side of a replacement's model and optimizer build."""
    groups = all_groups()
    for obj, index in _build_calls:
        group = None if index is None else groups[index]
        out = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, obj, group=group)



# ---- the restart ---------------------------------------------------------------------
def restart_in_process(trainer, failure: str) -> None:
    """Generation g failed (``failure`` says how this rank saw it): leave it and go on in
    generation g + 1 with the same model and optimizer objects, rolled back to the newest
    committed state. Every step is timed; one ``[REFT]`` line and one event say it."""
    from megatron.training import reft_integration
    from megatron.training.initialize import initialize_distributed
    from reft_ext.report.events import emit

    args, s, gen = trainer.args, trainer.state, generation()
    rank, g, t0 = gen.rank, gen.gen, time.time()
    gen.request_abort(failure[:200])
    gen.abort_now("this rank's collective failed")
    reason, at = gen.reason(), s.iteration
    if gen.abort_failure:  # NCCL's abort or the CUDA drain failed: no socket surgery
        emit("inprocess_unsafe", f"rank {rank}: generation {g} failed at iteration {at}; "
             f"in-process restart impossible ({gen.abort_failure}): restarting as a new "
             f"process", rank=rank, generation=g, why=gen.abort_failure)
        raise RestartError(f"aborting generation {g} in process failed: "
                           f"{gen.abort_failure}")
    planned = failure.startswith("PlannedSwap")  # a straggler's node leaves: no failure
    emit("inprocess_abort", f"rank {rank}: generation {g} " +
         ("ends for a straggler swap" if planned else "failed") + f" at iteration {at} "
         f"({reason}); restarting in this process (pid {os.getpid()})", rank=rank,
         generation=g, iteration=at, reason=reason, pid=os.getpid(), planned=planned)
    try:
        reft = getattr(trainer, "reft", None)  # None: the failure came before it opened
        if reft is not None:
            reft.abandon()  # no commit, no waits: the committed snapshot stays
            if reft in trainer.hooks:
                trainer.hooks.remove(reft)
        del reft
        old = teardown()
    except Exception as exc:  # noqa: BLE001 - this process cannot go on: replaced
        raise RestartError(f"leaving generation {g} failed: {exc!r}") from exc
    t_abort = time.time()
    if getattr(trainer, "goodput", None) is not None:  # goodput: the abort ends here
        trainer.goodput.switch("rejoin")
    gen.next_generation(timeout_s=60.0 * args.distributed_timeout_minutes, trained=at)
    t_gen = time.time()
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if persistent():  # the same group objects, generation g + 1's communicators
        changed, regrouped = 0, reconfigure(timeout)
    else:  # generation g + 1's groups, then every reference to the old ones rebound
        initialize_distributed(args)
        changed, regrouped = rebind(old, base_groups(), roots(trainer)), 0
    del old
    t_rdzv = time.time()
    reft_integration.startup_health_check(args)
    replay_build()
    if trainer.trace_group is not None:
        trainer.trace_group = reft_integration.trace_group(args)
    for chunk in s.model:  # a failure inside backward leaves partial gradients
        chunk.zero_grad_buffer()
    s.optimizer.zero_grad()
    trainer.restarts += 1
    trainer.timers = Timers(log_level=0, log_option="minmax")  # the step's were running
    if trainer.events is not None:
        trainer.events.interrupted()
    trainer._join()  # REFT-load (own memory; peers' for the replacements), agreement, data
    if getattr(trainer.reft, "enabled", False):
        trainer.reft.restarted_in_process = True
    # nothing restorable and this rank stepped: _join's agreement (training.py
    # _agree_start) made it restart as a new process, job-wide
    if not persistent():
        check_released(roots(trainer))
    gc.collect()  # the failed generation's cycles (exceptions, frames, Work objects)
    if persistent():
        wait_retired()  # its communicators' threads: ended by now
    trainer.losses = {i: v for i, v in trainer.losses.items() if i <= s.iteration}
    t_end = time.time()
    split = dict(abort=t_abort - t0, wait_generation=t_gen - t_abort,
                 rendezvous=t_rdzv - t_gen, rejoin=t_end - t_rdzv)
    emit("inprocess_restart", f"rank {rank}: restarted in process as generation "
         f"{gen.gen}: iteration {s.iteration} restored in {t_end - t0:.2f} s (" +
         ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in split.items()) +
         (f"); {regrouped} process groups reconfigured" if persistent() else
          f"); {changed} process-group references rebound"), rank=rank,
         generation=gen.gen, iteration=s.iteration, seconds=t_end - t0, pid=os.getpid(),
         rebound=changed, reconfigured=regrouped, **_resources(),
         **{f"{k}_s": v for k, v in split.items()})


def _resources() -> dict:
    """What a leak across restarts would grow: resident memory, open files and sockets,
    threads, mapped shared-memory segments."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.split()
    with open("/proc/self/maps") as f:
        shm = len({ln.split()[-1] for ln in f if "/dev/shm/" in ln})
    return dict(rss_mb=int(status["VmRSS"][0]) / 1024, threads=int(status["Threads"][0]),
                fds=len(os.listdir("/proc/self/fd")), shm_files=shm)
