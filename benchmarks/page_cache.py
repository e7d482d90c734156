"""Page-cache state of a checkpoint directory, for benchmarks that compare a cold read
from disk with host memory: evict the files (fsync + POSIX_FADV_DONTNEED, no root
needed) and *check* with mincore(2) that the pages really left the page cache. The
kernel may keep pages that are mapped by some process or that another reader touched
again; a "cold" figure measured on half-resident files would flatter the disk.

    python benchmarks/page_cache.py DIR [--drop]     # resident pages of DIR's files
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE


def _files(path: str):
    if os.path.isfile(path):
        yield path
        return
    for d, _, names in os.walk(path):
        for name in sorted(names):
            yield os.path.join(d, name)


def resident(path: str) -> tuple[int, int]:
    """(resident pages, total pages) of every file under ``path`` (or of one file). The
    mapping is never touched, so asking does not fault a page in."""
    got = total = 0
    for f in _files(path):
        size = os.path.getsize(f)
        if not size:
            continue
        pages = (size + PAGE - 1) // PAGE
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap of {f} failed")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {f} failed")
                got += sum(b & 1 for b in vec)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return got, total


def drop(path: str, tries: int = 3) -> tuple[int, int]:
    """Evict every file under ``path`` from the page cache and return (resident, total)
    pages as mincore sees them afterwards; retried (dirty pages being written back are
    not dropped at once)."""
    for _ in range(tries):
        for f in _files(path):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        got, total = resident(path)
        if got == 0:
            break
    return got, total


def warm(path: str) -> tuple[int, int]:
    """Read every file under ``path`` once, so the page cache holds all of it; returns
    (resident, total) pages afterwards."""
    for f in _files(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return resident(path)


def describe(got: int, total: int) -> str:
    return f"{got} of {total} pages ({100 * got / max(total, 1):.1f}%) in the page cache"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--drop", action="store_true", help="evict first (POSIX_FADV_DONTNEED)")
    a = ap.parse_args()
    if not os.path.exists(a.path):
        ap.error(f"{a.path}: no such file or directory")
    print(describe(*(drop(a.path) if a.drop else resident(a.path))))


if __name__ == "__main__":
    main()
