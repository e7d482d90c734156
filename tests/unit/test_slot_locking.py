"""Page-locked snapshot slots (state on a GPU, --reft-device-readahead > 0): which
segments the store locks, and its fallback where the driver refuses. Locking itself needs
CUDA (tests/gpu/test_device_staging_cuda.py locks a real slot); here ShmSegment.pin is
replaced by a recorder, or by the refusal an H100 gave for a mapping of a disk file
(cudaErrorInvalidValue, docs/gpu.md)."""

from __future__ import annotations

import threading

import pytest

from reft_ext.store import slots
from reft_ext.store.shm import ShmSegment

NBYTES = 1 << 20


@pytest.fixture
def store(shm_store):
    return shm_store


def test_slots_are_locked_when_made_and_the_aor_buffer_is_not(store, monkeypatch):
    locked = []
    monkeypatch.setattr(ShmSegment, "pin",
                        lambda seg, device=None: locked.append(seg.path) or True)
    store.pin_slots = True
    store.reserve(NBYTES, {"aor": 4096}, background=True)
    store.begin(NBYTES)
    store._settle()
    assert sorted(p.rsplit("/", 1)[1] for p in set(locked)) == \
        ["rank0.slot0.bin", "rank0.slot1.bin"]


def test_unlocked_store_locks_nothing(store, monkeypatch):
    monkeypatch.setattr(ShmSegment, "pin", lambda seg, device=None: pytest.fail("pinned"))
    store.reserve(NBYTES, background=True)
    store.begin(NBYTES)


def test_a_refused_lock_falls_back_to_unlocked_slots_said_once(store, monkeypatch, capsys):
    calls = []

    def refuse(seg, device=None):
        calls.append(seg.path)
        raise RuntimeError("cudaHostRegister(ptr, n, cudaHostRegisterPortable): "
                           "cudaErrorInvalidValue (invalid argument)")

    monkeypatch.setattr(ShmSegment, "pin", refuse)
    store.pin_slots = True
    store.reserve(NBYTES)  # attached now, locked at begin()
    for _ in range(3):
        slot, data = store.begin(NBYTES)
        data[:4] = 7  # the slot is usable
    out = capsys.readouterr()
    text = out.out + out.err
    assert len(calls) == 1 and not store.pin_slots
    assert text.count("cannot page-lock the snapshot slots") == 1
    assert "--reft-shm-dir" in text


def test_the_background_reservation_locks_for_the_callers_device(store, monkeypatch):
    """The slots are locked by the reservation thread with the device of the thread that
    asked for them (the rank's, recorded at reserve()), never the thread's own (a new
    thread's device is 0: a context on rank 0's GPU for every rank). Here the caller's
    device is 3 and any other thread's 0, as the CUDA runtime has it."""
    caller = threading.current_thread()
    monkeypatch.setattr(slots, "current_device",
                        lambda: 3 if threading.current_thread() is caller else 0)
    locked = []
    monkeypatch.setattr(ShmSegment, "pin", lambda seg, device=None: locked.append(
        (threading.current_thread().name, device)) or True)
    # the thread sets the rank's device first (tests/unit/test_page_lock_device.py): no CUDA here
    set_on = []
    monkeypatch.setattr(slots.torch.cuda, "set_device", lambda d: set_on.append(d))
    store.pin_slots = True
    store.reserve(NBYTES, background=True)
    store.release_slots()
    store._creator.join(30)
    store.begin(NBYTES)  # (the recorder leaves it unlocked: begin() locks it again)
    assert locked[:2] == [("reft-shm-reserve", 3), ("reft-shm-reserve", 3)]
    assert {dev for _, dev in locked} == {3} and set_on == [3]
