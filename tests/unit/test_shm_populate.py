"""A segment is mapped with every page faulted in (no fault per page on a snapshot's
path), by madvise(MADV_POPULATE_WRITE) with the GIL dropped, so a thread that maps slots
in the background leaves the training thread running (reft_ext/store/shm.py). Real
/dev/shm segments."""

from __future__ import annotations

import threading
import time
import uuid

from reft_ext.store import shm
from reft_ext.store.shm import ShmSegment

MB = 1 << 20


def _rss_kb(path: str) -> int:
    """Resident kB of this process's mapping of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_a_created_segment_is_resident_once_mapped():
    job = "pop" + uuid.uuid4().hex[:8]
    seg = ShmSegment.create(job, "slot.bin", 64 * MB, base_dir="/dev/shm")
    try:
        assert _rss_kb(seg.path) == 64 * 1024
        again = ShmSegment.attach(job, "slot.bin", base_dir="/dev/shm")
        assert _rss_kb(seg.path) == 2 * 64 * 1024  # both mappings
        again.close()
    finally:
        seg.close()
        ShmSegment.remove_job(job, base_dir="/dev/shm")


def test_populate_lets_another_thread_run_meanwhile(tmp_path):
    """The main thread ticks (sleeping 1 ms, taking the GIL again) while a thread
    populates 512 MB: with the GIL held for the whole call (mmap's MAP_POPULATE, or
    mmap.madvise) it cannot take the GIL again until the call ends."""
    job = "pop" + uuid.uuid4().hex[:8]
    seg = ShmSegment.create(job, "slot.bin", MB, base_dir="/dev/shm")
    path = seg.path
    seg.close()
    import mmap
    import os

    fd = os.open(path, os.O_RDWR)
    os.posix_fallocate(fd, 0, 512 * MB)
    mm = mmap.mmap(fd, 512 * MB, flags=mmap.MAP_SHARED)
    os.close(fd)
    done, ticks, ok, span = threading.Event(), [], [], []
    started = threading.Event()

    def populate():
        started.set()
        t0 = time.perf_counter()
        ok.append(shm._populate(mm))
        span.extend((t0, time.perf_counter()))
        done.set()

    t = threading.Thread(target=populate)
    t.start()
    started.wait()
    while not done.is_set():  # like a training thread: the GIL dropped and taken again
        time.sleep(0.001)
        ticks.append(time.perf_counter())
    t.join()
    during = [x for x in ticks if span[0] < x < span[1]]
    try:
        assert ok == [True]
        assert len(during) >= 10  # the main thread ran while the populate was under way
    finally:
        mm.close()
        ShmSegment.remove_job(job, base_dir="/dev/shm")
