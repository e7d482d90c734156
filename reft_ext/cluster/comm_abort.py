"""Aborting a process's communicators for an in-process restart, each backend by its own
means (the why and the protocol around it: reft_ext/cluster/inprocess.py's docstring).

NCCL groups are aborted by their own ``ProcessGroupNCCL.abort()`` and the CUDA device is
drained after it (each bounded); gloo has no working ``abort()`` for a rank blocked in a
collective, so for gloo groups the process's remaining peer TCP connections are shut
down, which wakes every blocked wait with an error. :func:`plan_abort` decides, as a pure
function of the groups' backends; :func:`abort_communicators` carries it out.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

import torch

from reft_ext.cluster.groups import BACKEND as GROUPS_BACKEND

ABORT_TIMEOUT_S = 60.0  # NCCL abort, then the CUDA drain, each at most


def _peer_socket(name: str, exclude_ports: set[int]) -> socket.socket | None:
    """fd ``name`` as a socket object (detach() it after use: the fd is gloo's) when it is
    a connected TCP socket whose peer port is not excluded, else None. An fd may close
    under us at any moment (gloo's own threads drop a dead peer's connection; an old
    generation's backends are destroyed on a thread): that is not an error."""
    try:
        if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
            return None
        s = socket.socket(fileno=int(name))
    except OSError:
        return None
    try:
        if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
            peer = s.getpeername()  # a listening socket has none: nobody waits on it
            if peer[1] not in exclude_ports:
                return s
    except OSError:
        pass
    s.detach()
    return None


def peer_sockets(exclude_ports: set[int]) -> list[int]:
    """File descriptors of this process's connected TCP sockets whose peer port is not in
    ``exclude_ports`` (the store's): the process groups' connections."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        s = _peer_socket(name, exclude_ports)
        if s is not None:
            fds.append(int(name))
            s.detach()
    return fds


def shutdown_peer_sockets(exclude_ports: set[int]) -> int:
    """Wake every wait on a peer connection with an error (see the module docstring);
    returns how many connections were shut down. One pass, each fd checked right before
    its shutdown (a list made first could name an fd closed, or reused, since)."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        s = _peer_socket(name, exclude_ports)
        if s is None:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n


@dataclass(frozen=True)
class AbortPlan:
    """What aborting this process's groups takes (:func:`plan_abort`)."""
    nccl: tuple[str, ...]   # groups whose NCCL backend gets ProcessGroupNCCL.abort()
    sockets: bool           # gloo groups exist: shut the remaining peer sockets after
    unsafe: str             # non-empty: no in-process abort (the reason); restart the process


def plan_abort(groups, cuda_available: bool, nccl_available: bool) -> AbortPlan:
    """``groups``: (name, backend) per process group, the backend as
    ``dist.get_backend`` says it ("gloo", "nccl", "cpu:gloo,cuda:nccl"). NCCL parts are
    aborted by NCCL, gloo parts by socket shutdown (after NCCL's abort, so that no NCCL
    socket is ever shut by us); anything else cannot be aborted safely here."""
    nccl, gloo, unsafe = [], False, []
    for name, backend in groups:
        parts = {p.rpartition(":")[2].strip() for p in str(backend).lower().split(",")}
        parts = {"gloo" if p == GROUPS_BACKEND else p for p in parts}  # gloo inside
        if parts - {"gloo", "nccl"}:
            unsafe.append(f"group {name} has backend {backend!r} (only gloo and nccl "
                          f"can be aborted in process)")
        if "nccl" in parts:
            nccl.append(name)
        gloo = gloo or "gloo" in parts
    if nccl and not (cuda_available and nccl_available):
        unsafe.append(f"NCCL groups {nccl} without CUDA/NCCL in this process")
    return AbortPlan(tuple(nccl), gloo, "; ".join(unsafe))


def _bounded(fn, timeout_s: float, what: str) -> str:
    """Run ``fn`` on a daemon thread for at most ``timeout_s``: "" or why it failed."""
    err: list = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported, the caller decides
            err.append(exc)
    t = threading.Thread(target=run, name=f"reft-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return f"{what} did not return within {timeout_s:.0f} s"
    return f"{what} failed: {err[0]!r}" if err else ""


def _abort_nccl(pgs: list) -> None:
    """ProcessGroupNCCL.abort() of each group, inside one ncclGroupStart/End as torch's
    own ``_abort_process_group`` does (separate aborts can deadlock: torch #119797)."""
    backends = [pg._get_backend(torch.device("cuda")) for pg in pgs]
    backends[0]._group_start()
    try:
        for b in backends:
            b.abort()
    finally:
        backends[0]._group_end()


def abort_communicators(exclude_ports: set[int], device=None,
                        timeout_s: float = ABORT_TIMEOUT_S) -> tuple[AbortPlan, int, str]:
    """Abort every process group of this process per :func:`plan_abort`, draining
    ``device``'s CUDA streams after NCCL's abort. Returns (plan, sockets shut, failure);
    on a failure nothing further is done (NCCL's sockets are NCCL's)."""
    from torch.distributed import distributed_c10d as c10d

    described = []
    for pg, name in list(c10d._world.pg_names.items()):  # a copy: the main thread runs
        try:
            described.append((pg, name, str(torch.distributed.get_backend(pg))))
        except Exception as exc:  # noqa: BLE001 - a destroyed group: nothing to abort
            described.append((pg, name, f"unknown ({exc})"))
    plan = plan_abort([(n, b) for _, n, b in described], torch.cuda.is_available(),
                      torch.distributed.is_nccl_available())
    if plan.unsafe:
        return plan, 0, plan.unsafe
    if plan.nccl:
        pgs = [pg for pg, name, _ in described if name in plan.nccl]
        failure = _bounded(lambda: _abort_nccl(pgs), timeout_s, "ProcessGroupNCCL.abort()")
        if not failure and device is not None:
            failure = _bounded(lambda: torch.cuda.synchronize(device), timeout_s,
                               f"draining the CUDA streams of {device}")
        if failure:
            return plan, 0, failure
    return plan, (shutdown_peer_sockets(exclude_ports) if plan.sockets else 0), ""


