"""HAS with PP > 1 when the state is on a device: the planner (Algorithm 1) and the real
snapshot thread (HasWorker) of the HAS schedule. The CPU of a GPU rank never sits in an
NCCL p2p call for a bubble's length, so units waiting for "bubbles" ran at the blocking
drain: 100 of 100 planned tier 1 on the first snapshot (bandwidth unknown). Device units
are copied by the copy engine whatever the CPU does: planned beside compute, they leave
the drain."""

from __future__ import annotations

import time

from reft_ext.report.timeline import PipelineEvents
from reft_ext.save.has import TIER1, TIER2, Batch, Unit
from reft_ext.save.schedules import make_schedule
from reft_ext.save.tiers import Bandwidth, plan_tiers
from reft_ext.store.checksum import CHUNK

PIPELINE = (4, 1, 8)  # PP 4, no interleaving, 8 micro-batches: a 3/8 step bubble


def _units(n: int, ran: list, delay: float = 0.0):
    def make(i):
        def run():
            time.sleep(delay)
            ran.append(i)
            return i
        return run
    return [Unit("owned", i, CHUNK, make(i)) for i in range(n)]


def _schedule(device: bool):
    events = PipelineEvents(0)
    events.profile.waits.extend([0.3] * 3)     # measured bubbles (GpuIdleClock on a GPU)
    events.profile.computes.extend([0.8] * 3)  # and compute per step
    return events, make_schedule("has", events, Bandwidth(), PIPELINE, concurrent=True,
                                 device=device)


def test_device_units_leave_the_drain_with_pp_gt_1():
    """First snapshot (bandwidth unknown), PP 4, a 0.3 s bubble the CPU never hears: the
    units of device state run beside compute before the drain is asked for."""
    events, sched = _schedule(device=True)
    ran: list[int] = []
    batch = Batch(_units(10, ran, delay=0.01), iteration=1)
    try:
        sched.submit(batch)
        assert all(u.tier == TIER2 for u in batch.units)
        deadline = time.monotonic() + 20
        while not batch.finished and time.monotonic() < deadline:
            time.sleep(0.01)  # "forward-backward": no p2p wait is ever reported
        waited = sched.drain()
    finally:
        sched.close()
    assert sorted(ran) == list(range(10)) and batch.finished
    assert batch.by_how["compute"] == 10 * CHUNK and batch.by_how["drain"] == 0
    assert waited < 1.0


def test_host_units_without_bandwidth_are_not_all_tier1():
    """Host state, bandwidth unknown: the bubble holds what a conservative rate copies in
    it (PRIOR_BANDWIDTH), not the whole snapshot; the rest is tier 2."""
    _, sched = _schedule(device=False)
    ran: list[int] = []
    batch = Batch(_units(100, ran), iteration=1)
    sched.plan(batch)
    sched.close()
    tier1 = sum(u.tier == TIER1 for u in batch.units)
    assert 0 < tier1 < 100
    assert (tier1 - 1) * CHUNK < batch.split.bubble_bytes <= tier1 * CHUNK


def test_the_old_behaviour_left_everything_to_the_drain():
    """What device=False planning does to device state (the defect, kept as the control):
    every unit waits for a bubble the CPU does not hear, so all run at the drain."""
    events, sched = _schedule(device=False)
    ran: list[int] = []
    batch = Batch(_units(10, ran), iteration=1)
    plan_tiers(batch, None, 0.3, True)  # the old first-snapshot rule: bubbles only
    for u in batch.units:
        u.tier = TIER1
    try:
        sched.worker.submit(batch)
        time.sleep(0.2)
        assert ran == []  # nothing beside compute: tier 1 waits for a p2p wait
        sched.drain()
    finally:
        sched.close()
    assert batch.by_how["drain"] == 10 * CHUNK and batch.by_how["compute"] == 0
