"""A background reservation (SnapshotStore.reserve(background=True): a fresh start's or
a replacement's segments) makes the named buffers at once and the slots only once the
caller has released them (after its recovery and start-up), or at a slot's first use;
a store settled before any release makes no slot. Real /dev/shm segments."""

from __future__ import annotations

import os
import time

import pytest


NBYTES = 1 << 20


@pytest.fixture
def store(shm_store):
    return shm_store


def _files(store) -> list[str]:
    return sorted(os.listdir(store.dir))


def _until(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_buffers_first_slots_after_the_release(store):
    store.reserve(NBYTES, {"aor": 4096}, background=True)
    assert store.buffer("aor", 4096).numel() == 4096  # made by the thread, waited for
    time.sleep(0.2)
    assert _files(store) == ["rank0.aor.bin"]  # the slots wait for the release
    store.release_slots()
    assert _until(lambda: len(_files(store)) == 3)
    store._settle()
    assert set(store._segs) == {"aor", 0, 1}


def test_a_slot_used_before_the_release_is_made_then(store):
    store.reserve(NBYTES, {"aor": 4096}, background=True)
    slot, data = store.begin(NBYTES)
    data[:4] = 1
    assert f"rank0.slot{slot}.bin" in _files(store)


def test_settled_before_any_release_makes_no_slot(store):
    store.reserve(NBYTES, {"aor": 4096}, background=True)
    store.buffer("aor", 4096)
    store._settle()  # a start that failed: close, hand over
    assert _files(store) == ["rank0.aor.bin"]
    slot, data = store.begin(NBYTES)  # a later first use makes it
    assert data.numel() == NBYTES
