"""reft_ext/store/atomic.py on a full filesystem: a clear ENOSPC error naming the file and
what to do, the previous version intact, no temporary left (a real 64 KiB tmpfs; needs
root to mount it, as a full /dev/shm needs a real tmpfs)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from reft_ext.store.atomic import write_atomic


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_filesystem_keeps_the_old_version_and_says_why(tiny_tmpfs):
    target = os.path.join(tiny_tmpfs, "committed")
    write_atomic(target, "iteration 7")
    fd = os.open(os.path.join(tiny_tmpfs, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # fill it up
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        write_atomic(target, "iteration 8" * 2000, durable=True)
    assert info.value.errno == errno.ENOSPC
    assert f"no space left on the filesystem of {tiny_tmpfs} to write committed" \
        in str(info.value) and "previous version is intact" in str(info.value)
    assert open(target).read() == "iteration 7"
    assert sorted(os.listdir(tiny_tmpfs)) == ["committed", "filler"]
