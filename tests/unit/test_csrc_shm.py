"""Shared-memory segments: lifecycle, permissions, space errors, survival of a SIGKILLed writer."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest
import torch

from reft_ext.store.shm import ShmSegment, ShmSpaceError, job_dir

pytestmark = pytest.mark.timeout(120)

SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@pytest.fixture
def base():
    """A private base directory under /dev/shm, removed with everything in it."""
    d = tempfile.mkdtemp(prefix="reft-test-", dir=SHM_ROOT)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def job():
    return f"t{uuid.uuid4().hex[:12]}"


def test_create_attach_resize_unlink(base, job):
    seg = ShmSegment.create(job, "snap0", 1 << 20, base_dir=base)
    d = job_dir(job, base)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    assert seg.path == os.path.join(d, "snap0")
    t = seg.tensor()
    assert t.dtype == torch.uint8 and t.numel() == 1 << 20
    t.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    f = seg.tensor(torch.float32, offset=8, count=10)
    assert f.numel() == 10 and f.data_ptr() == t.data_ptr() + 8  # zero-copy views
    with pytest.raises(FileExistsError):
        ShmSegment.create(job, "snap0", 10, base_dir=base)

    other = ShmSegment.attach(job, "snap0", base_dir=base)  # second mapping, same bytes
    assert other.nbytes == 1 << 20 and torch.equal(other.tensor(), t)
    other.tensor()[0] = 77
    assert int(t[0]) == 77
    other.close()

    seg.resize(3 << 20)  # grow: old prefix kept, old views still valid
    assert seg.nbytes == 3 << 20 and os.path.getsize(seg.path) == 3 << 20
    assert int(t[0]) == 77 and torch.equal(seg.tensor()[:1 << 20], t)
    assert not seg.tensor()[1 << 20:].any()
    with pytest.raises(RuntimeError, match="views"):
        seg.resize(100)  # shrinking under live views would SIGBUS them
    del t, f
    seg.resize(100)
    assert seg.nbytes == 100 and int(seg.tensor()[0]) == 77
    assert ShmSegment.list(job, base_dir=base) == ["snap0"]
    assert ShmSegment.exists(job, "snap0", base_dir=base)
    seg.unlink()
    assert not ShmSegment.exists(job, "snap0", base_dir=base)
    assert not os.path.exists(d)  # last segment gone -> job directory removed


def test_views_outlive_close_and_pin_without_cuda(base, job):
    seg = ShmSegment.create(job, "v", 8192, base_dir=base)
    view = seg.tensor(torch.int32)
    view.fill_(-5)
    seg.close()  # must not unmap memory that a live tensor still points to
    assert int(view.sum()) == -5 * 2048
    seg = ShmSegment.attach(job, "v", base_dir=base)
    assert int(seg.tensor(torch.int32)[7]) == -5
    if not torch.cuda.is_available():
        assert seg.pin() is False and not seg.pinned
    else:
        assert seg.pin() and seg.pinned
        seg.unpin()
    seg.unlink()


def test_attach_missing_and_bad_names(base, job):
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach(job, "nope", base_dir=base)
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ValueError):
            ShmSegment.create(job, bad, 1, base_dir=base)
    with pytest.raises(ValueError):
        ShmSegment.create("../evil", "x", 1, base_dir=base)


def test_attach_refuses_shared_permissions(base, job):
    seg = ShmSegment.create(job, "s", 4096, base_dir=base)
    os.chmod(seg.path, 0o644)
    with pytest.raises(PermissionError):
        ShmSegment.attach(job, "s", base_dir=base)
    seg.unlink()


def test_zero_size_and_remove_job(base, job):
    z = ShmSegment.create(job, "empty", 0, base_dir=base)
    assert z.tensor().numel() == 0
    z.resize(4096)
    z.tensor().fill_(1)
    z.close()
    ShmSegment.create(job, "b", 10, base_dir=base).close()
    assert ShmSegment.list(job, base_dir=base) == ["b", "empty"]
    ShmSegment.remove_job(job, base_dir=base)
    assert ShmSegment.list(job, base_dir=base) == []


def test_too_little_space_is_a_clear_error_before_allocation(base, job):
    free = shutil.disk_usage(base).free
    with pytest.raises(ShmSpaceError) as ei:
        ShmSegment.create(job, "huge", free + (1 << 30), base_dir=base)
    msg = str(ei.value)
    assert "--reft-host-memory-limit" in msg and "--reft-shm-dir" in msg
    assert str(free + (1 << 30)) in msg
    assert not ShmSegment.exists(job, "huge", base_dir=base)  # nothing left behind
    seg = ShmSegment.create(job, "small", 4096, base_dir=base)
    with pytest.raises(ShmSpaceError):
        seg.resize(free + (2 << 30))
    assert seg.nbytes == 4096 and os.path.getsize(seg.path) == 4096
    seg.unlink()


WRITER = textwrap.dedent("""
    import hashlib, sys, time, torch
    from reft_ext.copy.engine import CopyEngine
    from reft_ext.store.shm import ShmSegment
    base, job, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    g = torch.Generator().manual_seed(2024)
    state = {"w": torch.randn(n // 8, generator=g), "m": torch.randn(n // 8, generator=g).bfloat16()}
    seg = ShmSegment.create(job, "rank0", n, base_dir=base)
    items, off = [], 0
    for t in state.values():
        nb = t.numel() * t.element_size()
        items.append((t, seg.tensor(), 0, off, nb))
        off += nb
    CopyEngine(num_threads=2).submit(items).wait()
    print("READY", hashlib.sha256(seg.tensor()[:off].numpy().tobytes()).hexdigest(), off, flush=True)
    time.sleep(600)  # keep the mapping open: killed here
""")

READER = textwrap.dedent("""
    import hashlib, sys
    from reft_ext.store.shm import ShmSegment
    seg = ShmSegment.attach(sys.argv[2], "rank0", base_dir=sys.argv[1])
    n = int(sys.argv[3])
    print(seg.nbytes, hashlib.sha256(seg.tensor()[:n].numpy().tobytes()).hexdigest(), flush=True)
""")


def test_segment_survives_sigkill_of_writer(base, job):
    n = 6 << 20
    w = subprocess.Popen([sys.executable, "-c", WRITER, base, job, str(n)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = w.stdout.readline().split()
        assert line and line[0] == "READY", w.stderr.read()
        digest, used = line[1], int(line[2])
        w.send_signal(signal.SIGKILL)
        assert w.wait(timeout=30) == -signal.SIGKILL  # it really died by SIGKILL (-9)
    finally:
        if w.poll() is None:
            w.kill()
        w.stdout.close()
        w.stderr.close()
    # Independent expectation computed here, then a fresh process reads the segment.
    g = torch.Generator().manual_seed(2024)
    wt, mt = torch.randn(n // 8, generator=g), torch.randn(n // 8, generator=g).bfloat16()
    expect = wt.numpy().tobytes() + mt.view(torch.int16).numpy().tobytes()
    assert used == len(expect) and hashlib.sha256(expect).hexdigest() == digest
    r = subprocess.run([sys.executable, "-c", READER, base, job, str(used)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    size, read_digest = r.stdout.split()
    assert int(size) == n and read_digest == digest
    ShmSegment.remove_job(job, base_dir=base)
