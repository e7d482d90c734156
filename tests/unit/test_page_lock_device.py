"""The page-locking thread and the device guard's contract (issue 58, item 2): a rank's
background reservation page-locks its slots on a thread of its own, which sets the
rank's device itself before any CUDA call; the registration asks the native guard for
no device (-1: it sets none and restores none, so a thread's "previous" device 0 is
never made current, which would make a context on GPU 0 since CUDA 12), and torch's
guard around it restores only a device that has a context. Without a device here, the
CUDA calls are stand-ins that record, per thread, the device each call ran with; the
segments are real /dev/shm ones. (A lease shows the real thing: docs/gpu.md.)"""

from __future__ import annotations

import threading

import pytest
import torch

from reft_ext import _native
from reft_ext.store import shm as shm_mod

RANK_DEVICE = 3


class _Cuda:
    """Per-thread current device (a new thread's is 0, as in the CUDA runtime)."""

    def __init__(self):
        self.local = threading.local()
        self.calls: list[tuple[str, str, int, object]] = []  # (call, thread, current, arg)

    def current(self) -> int:
        return getattr(self.local, "dev", 0)

    def set_device(self, d):
        self.calls.append(("set_device", threading.current_thread().name, self.current(), d))
        self.local.dev = int(d)

    def register(self, ptr, n, device):
        self.calls.append(("register", threading.current_thread().name, self.current(),
                           device))


@pytest.fixture
def cuda(monkeypatch):
    c = _Cuda()

    class _Guard:  # torch.cuda.device: exchange, and back only to a device with context
        def __init__(self, d):
            self.d = int(d)

        def __enter__(self):
            self.prev = c.current()
            if self.d != self.prev:
                c.set_device(self.d)

        def __exit__(self, *exc):
            if self.prev != c.current() and self.prev in getattr(c.local, "ctx", ()):
                c.set_device(self.prev)
            return False

    class _C:
        cuda_host_register = staticmethod(c.register)

        @staticmethod
        def cuda_host_unregister(ptr):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", c.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", c.current)
    monkeypatch.setattr(torch.cuda, "device", _Guard)
    monkeypatch.setattr(_native, "C", _C)
    monkeypatch.setattr(_native, "HAVE_NATIVE_CUDA", True)
    return c


# (cuda before shm_store: the store is closed, its slots unlocked, with the stand-ins)
def test_the_page_locking_thread_sets_the_ranks_device_and_the_guard_none(cuda, shm_store):
    store = shm_store
    store.pin_slots = True
    cuda.set_device(RANK_DEVICE)  # the training thread's, as initialize.py sets it
    store.reserve(1 << 20, {"aor": 4096}, background=True)
    store.release_slots()
    store.begin(1 << 20)  # waits for its slot
    store.close()
    regs = [c for c in cuda.calls if c[0] == "register"]
    assert len(regs) == len(store.slots), cuda.calls  # every slot locked, on the thread
    assert all(t == "reft-shm-reserve" and cur == RANK_DEVICE and arg == -1
               for _, t, cur, arg in regs), regs
    on_thread = [c for c in cuda.calls if c[1] == "reft-shm-reserve"]
    assert on_thread[0] == ("set_device", "reft-shm-reserve", 0, RANK_DEVICE), on_thread
    # no call anywhere made device 0 current (what a restore on a new thread does)
    assert not [c for c in cuda.calls if c[0] == "set_device" and c[3] == 0], cuda.calls


def test_a_segment_locked_for_another_device_leaves_the_thread_as_it_was(cuda, shm_store):
    """pin(device) on a thread whose device has no context: the registration runs with
    ``device`` current, and the guard does not switch back to the context-less one."""
    seg = shm_mod.ShmSegment.create(shm_store.job, "probe.bin", 8192,
                                    base_dir=shm_store.base_dir)
    try:
        assert seg.pin(device=RANK_DEVICE)
        assert cuda.calls == [("set_device", "MainThread", 0, RANK_DEVICE),
                              ("register", "MainThread", RANK_DEVICE, -1)], cuda.calls
        seg.unpin()
    finally:
        seg.close()
