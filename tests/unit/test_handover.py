"""A failed generation's snapshot store hands its mapped segments to the next store of
the same process (reft_ext/store/handover.py): the survivor of an in-process restart
does not map (and populate) its slots again. Real /dev/shm segments."""

import os
import uuid

import pytest
import torch

from reft_ext.store import handover
from reft_ext.store.shm import ShmSegment
from reft_ext.store.slots import SnapshotStore

NBYTES = 1 << 20


@pytest.fixture
def store_args():
    job = "ho" + uuid.uuid4().hex[:8]
    yield (job, 0, 0, "/dev/shm")
    handover.release()
    ShmSegment.remove_job(f"{job}/node0", base_dir="/dev/shm")


def _count_attaches(monkeypatch) -> list:
    calls = []
    real = ShmSegment.attach.__func__

    def counted(cls, *a, **k):
        calls.append(a)
        return real(cls, *a, **k)

    monkeypatch.setattr(ShmSegment, "attach", classmethod(counted))
    return calls


def test_the_next_store_claims_the_mapped_segments(store_args, monkeypatch):
    old = SnapshotStore(*store_args, slots=2)
    old.reserve(NBYTES, {"aor": 4096})
    slot, data = old.begin(NBYTES)
    data[:8] = torch.arange(8, dtype=torch.uint8)
    mapped = {k: s for k, s in old._segs.items()}
    old.hand_over()
    assert handover.held() == 3 and not old._segs
    attaches = _count_attaches(monkeypatch)
    new = SnapshotStore(*store_args, slots=2)
    new.reserve(NBYTES, {"aor": 4096})
    # the same mapped objects, none attached again, nothing left waiting
    assert all(new._segs[k] is seg for k, seg in mapped.items())
    assert attaches == [] and handover.held() == 0
    assert torch.equal(new.data(slot, NBYTES)[:8], torch.arange(8, dtype=torch.uint8))
    new.close()


def test_a_replaced_file_is_attached_anew_and_leftovers_are_closed(store_args, monkeypatch):
    old = SnapshotStore(*store_args, slots=2)
    old.reserve(NBYTES)
    segs = dict(old._segs)
    old.hand_over()
    # slot 0's file is replaced under the same name (another run's cleanup and start)
    path = segs[0].path
    os.unlink(path)
    fresh = ShmSegment.create(f"{store_args[0]}/node0", os.path.basename(path), NBYTES,
                              base_dir="/dev/shm")
    fresh.close()
    attaches = _count_attaches(monkeypatch)
    new = SnapshotStore(*store_args, slots=2)
    new.reserve(NBYTES)
    assert new._segs[0] is not segs[0] and new._segs[1] is segs[1]
    assert len(attaches) == 1 and segs[0]._fd is None  # the stale mapping was closed
    # a segment no new store wants (another layout) is closed by the next reserve
    extra = SnapshotStore(*store_args, slots=2)
    extra.reserve(NBYTES, {"other": 4096})
    other = extra._segs["other"]
    extra.hand_over()
    new2 = SnapshotStore(*store_args, slots=2)
    new2.reserve(NBYTES)
    assert handover.held() == 0 and other._fd is None
    new.close()
    new2.close()
