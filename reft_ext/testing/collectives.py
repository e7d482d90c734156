"""What REFT costs an iteration in collectives and time (``REFT_COUNT_COLLECTIVES=1``).

REFT's added cost must not grow with the job (issue 34): nothing it adds to an iteration
may span the world. This counter makes that checkable. Installed by the session when the
variable is set (never otherwise: production pays one environment lookup at start), it
wraps torch.distributed's collectives and point-to-point calls; a call whose innermost
caller outside torch is REFT's code (reft_ext/, or the trainer's REFT integration) is
recorded with its group size, its bytes and where it came from; megatron-core's own
collectives (also those HAS times through its p2p wrappers) are not REFT's and are not
counted. At the end of each iteration the session closes the iteration: one
``reft_iteration`` event per rank with the calls (and the time the training thread spent
inside REFT's hooks), read by tests/integration/test_reft_collectives.py and
benchmarks/bench_world_size.py.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import threading
import time

ENV = "REFT_COUNT_COLLECTIVES"
OPS = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
       "broadcast", "broadcast_object_list", "barrier", "reduce_scatter_tensor",
       "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv",
       "monitored_barrier")
_REFT = (os.sep + "reft_ext" + os.sep, os.sep + "reft_integration.py",
         os.sep + "startup_health_check.py")  # the trainer's REFT integration
_SELF = os.path.abspath(__file__)


def _nbytes(args, kwargs) -> int:
    """Tensor bytes of the call's arguments; an object collective's pickled object."""
    import torch

    n = 0
    for a in list(args) + list(kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for x in items:
            if isinstance(x, torch.Tensor):
                n += x.numel() * x.element_size()
    if n == 0 and args and not isinstance(args[-1], torch.Tensor):
        try:  # all_gather_object(out, obj) / broadcast_object_list(objs)
            n = len(pickle.dumps(args[1] if len(args) > 1 else args[0]))
        except Exception:  # noqa: BLE001 - an estimate only
            n = 0
    return n


def _caller() -> str | None:
    """"file:function" of the innermost frame outside torch if it is REFT's, else None."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if os.sep + "torch" + os.sep not in path and os.path.abspath(path) != _SELF:
            if any(p in path for p in _REFT):
                return f"{os.path.basename(path)}:{f.f_code.co_name}"
            return None
        f = f.f_back
    return None


class CollectiveCounter:
    """The wrapped torch.distributed functions and the calls of the iteration so far."""

    def __init__(self):
        self.calls: list[dict] = []
        self.training_thread = threading.current_thread()
        self._lock = threading.Lock()
        self._orig: dict = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in OPS:
            fn = getattr(dist, name, None)
            if fn is None or name in self._orig:
                continue
            self._orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._orig.items():
            setattr(dist, name, fn)
        self._orig.clear()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            where = _caller()
            if where is not None:
                import torch.distributed as dist

                group = kwargs.get("group")
                size = dist.get_world_size(group) if group is not None else \
                    dist.get_world_size()
                call = {"op": name, "group_size": size, "bytes": _nbytes(args, kwargs),
                        "where": where,
                        "training_thread": threading.current_thread() is self.training_thread}
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:  # the wait for the slowest member included (async ops: the post)
                    call["ms"] = 1000 * (time.perf_counter() - t0)
                    with self._lock:
                        self.calls.append(call)
            return fn(*args, **kwargs)
        return counted

    def take(self) -> list[dict]:
        with self._lock:
            calls, self.calls = self.calls, []
        return calls


_counter: CollectiveCounter | None = None


def maybe_install() -> CollectiveCounter | None:
    """The process's counter, installed on first call when ``REFT_COUNT_COLLECTIVES=1``."""
    global _counter
    if _counter is None and os.environ.get(ENV) == "1":
        _counter = CollectiveCounter()
        _counter.install()
    return _counter


def end_iteration(iteration: int, reft_s: float, reft_cpu_s: float = 0.0) -> None:
    """One ``reft_iteration`` event: this iteration's REFT collectives and the seconds
    the training thread spent inside REFT's hooks, wall and CPU (nothing without the
    counter)."""
    if _counter is None:
        return
    from reft_ext.report.events import record

    record("reft_iteration", iteration=iteration, reft_ms=1000 * reft_s,
           reft_cpu_ms=1000 * reft_cpu_s, calls=_counter.take())
