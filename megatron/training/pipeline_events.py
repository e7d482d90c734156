"""The seams through which megatron-core's pipeline schedules report what each stage is
doing, without a copy of schedules.py (docs/has.md, "Where the bubbles
come from"):

* ``ModelParallelConfig.timers``: the schedules call ``config.timers(name).start()/stop()``
  around every phase (``forward-compute``, ``backward-compute``, ``forward-recv``,
  ``backward-send-forward-recv``, ...). :class:`PhaseTimers` turns the compute phases
  into events and remembers which p2p phase is running, to name the wait.
* ``p2p_communicator=``: :class:`EventP2PCommunicator` overrides the one method every
  p2p exchange goes through, ``P2PCommunicator._communicate``, and reports the time the
  stage is blocked in it (a bubble). With ``overlap_p2p_comm`` the exchange only posts
  requests; their ``wait()`` is wrapped instead, so the real waits are seen either way.

Both report to a :class:`reft_ext.report.timeline.PipelineEvents`. On a GPU the step
profile HAS plans with is measured by CUDA events instead (``GpuIdleClock``,
reft_ext/save/bubbles.py): a p2p call returns before the GPU is idle, so the bubble is
the compute stream's idle time between compute phases; the CPU path is unchanged.

The timers are also the seam of ``--inject-fault ...@forward|backward|send|recv`` (reft_ext/testing/
fault_specs.py): a rank with such a fault gets them even when no events are wanted. ``check_seams()`` verifies
that megatron-core still has the signatures this relies on; tests/integration/test_has.py runs it,
so an upgrade that moves them fails a test rather than silently losing the bubbles.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

from reft_ext.report.timeline import PipelineEvents
from reft_ext.save.bubbles import GpuIdleClock, GpuStepProfile
from reft_ext.testing import fault_point

COMPUTE_PHASES = ("forward-compute", "backward-compute")
_SCHEDULE_GROUPS = ["tp", "cp", "embd", "pos_embd", "pp", "dp_cp"]


def fault_phases(name: str) -> tuple[str, ...]:
    """The ``--inject-fault`` phases a timer starts: forward-compute -> forward,
    backward-compute -> backward, a p2p timer -> send and/or recv
    (backward-send-forward-recv -> send, recv)."""
    if name == "forward-compute":
        return ("forward",)
    if name == "backward-compute":
        return ("backward",)
    return tuple(p for p in ("send", "recv") if p in name)


class _PhaseTimer:
    __slots__ = ("owner", "name", "faults")

    def __init__(self, owner: PhaseTimers, name: str):
        self.owner, self.name = owner, name
        self.faults = fault_phases(name)

    def start(self, barrier: bool = False) -> None:
        owner = self.owner
        if owner.events is not None:
            if self.name in COMPUTE_PHASES:
                owner.events.phase_begin(self.name)
                if owner.clock is not None:
                    owner.clock.compute_begin()
            elif "send" in self.name or "recv" in self.name:
                owner.p2p_phase = self.name
        if owner.iteration is not None:  # --inject-fault ...@forward|backward|send|recv
            for phase in self.faults:  # (after phase_begin: a rank frozen here computes)
                fault_point(phase, iteration=owner.iteration)

    def stop(self, barrier: bool = False) -> None:
        if self.name in COMPUTE_PHASES and self.owner.events is not None:
            if self.owner.clock is not None:
                self.owner.clock.compute_end()
            self.owner.events.phase_end(self.name)


class PhaseTimers:
    """A ``config.timers`` callable: ``timers(name, log_level=None)`` -> start/stop.

    ``events`` (None: only faults) get the compute phases and the running p2p phase;
    ``iteration``, set by the trainer for each training step (None while evaluating or
    when no fault of these phases is asked for), names the iteration whose phases pass
    :func:`reft_ext.testing.fault_point` (``--inject-fault ...@forward`` ...)."""

    def __init__(self, events: PipelineEvents | None):
        self.events = events
        self.iteration: int | None = None
        self.p2p_phase = "p2p"
        self.clock: GpuIdleClock | None = None  # set by install() on a GPU
        self._timers: dict[str, _PhaseTimer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _PhaseTimer:
        t = self._timers.get(name)
        if t is None:
            t = self._timers[name] = _PhaseTimer(self, name)
        return t


class _TimedReq:
    """A p2p request whose ``wait()`` is reported as a bubble (overlapped p2p)."""

    def __init__(self, req, events: PipelineEvents, name: str):
        self._req, self._events, self._name = req, events, name

    def wait(self, *args, **kwargs):
        self._events.wait_begin(self._name)
        try:
            return self._req.wait(*args, **kwargs)
        finally:
            self._events.wait_end()

    def __getattr__(self, item):
        return getattr(self._req, item)


class EventP2PCommunicator(P2PCommunicator):
    """megatron-core's communicator, with its waits reported as bubbles."""

    def __init__(self, pp_group, config, events: PipelineEvents, timers: PhaseTimers):
        super().__init__(pp_group=pp_group, config=config)
        self.events, self.timers = events, timers

    def _communicate(self, **kwargs):
        name = self.timers.p2p_phase
        if not kwargs.get("wait_on_reqs", True):
            prev, nxt, reqs = super()._communicate(**kwargs)
            if isinstance(reqs, dict):
                reqs = {k: _TimedReq(r, self.events, name) for k, r in reqs.items()}
            elif reqs:
                reqs = [_TimedReq(r, self.events, name) for r in reqs]
            return prev, nxt, reqs
        self.events.wait_begin(name)
        try:
            return super()._communicate(**kwargs)
        finally:
            self.events.wait_end()


def install(config, events: PipelineEvents | None, on_gpu: bool | None = None) -> dict:
    """Point ``config.timers`` at the events and return the extra keyword arguments for
    the forward-backward function (a communicator that reports waits), {} without PP.
    ``events`` None: only the fault seam (the timers), megatron-core's own communicator.
    ``on_gpu`` (None: CUDA is in use, the model having been built there): bubbles and
    compute are timed by CUDA events (GpuIdleClock), not by the CPU."""
    timers = PhaseTimers(events)
    config.timers = timers
    if events is None or mpu.get_pipeline_model_parallel_world_size() == 1:
        return {}
    if on_gpu is None:
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if on_gpu:
        timers.clock = GpuIdleClock()
        events.profile = GpuStepProfile(timers.clock)
    comm = EventP2PCommunicator(mpu.get_pipeline_model_parallel_group(), config, events,
                                timers)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=_SCHEDULE_GROUPS)
    return {"p2p_communicator": comm, "pg_collection": pgs}


def check_seams() -> list[str]:
    """What this module relies on in megatron-core; returns the problems found."""
    problems = []
    params = inspect.signature(P2PCommunicator._communicate).parameters
    for p in ("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next",
              "tensor_shape", "wait_on_reqs"):
        if p not in params:
            problems.append(f"P2PCommunicator._communicate lost parameter {p!r}")
    for fn in (schedules.forward_backward_pipelining_without_interleaving,
               schedules.forward_backward_pipelining_with_interleaving):
        sig = inspect.signature(fn).parameters
        for p in ("p2p_communicator", "pg_collection"):
            if p not in sig:
                problems.append(f"{fn.__name__} no longer takes {p}=")
    src = inspect.getsource(schedules)
    for phase in COMPUTE_PHASES:
        if f"config.timers('{phase}'" not in src:
            problems.append(f"schedules.py no longer times {phase!r} through config.timers")
    return problems
