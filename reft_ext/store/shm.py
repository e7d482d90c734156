"""Named POSIX shared-memory segments that outlive the training process.

A segment is a file ``<base>/reft-<job_id>/<name>`` on a tmpfs (a failure domain's
namespace ``<job>/node<n>``: ``<base>/reft-<job>/node<n>/<name>``; reft_ext/store/paths.py;
default base: ``$REFT_SHM_DIR`` or ``/dev/shm``), directory mode 0700, file mode 0600,
created with O_CREAT|O_EXCL so two writers never share one by accident.  It is
mapped MAP_SHARED and exposed as a zero-copy torch tensor; after the process
dies (even by SIGKILL) the bytes stay in the page cache of the tmpfs and a new
process ``attach``es to them.

Space is checked with statvfs *before* the file grows, then reserved with
posix_fallocate, so running out of /dev/shm is a clear ShmSpaceError at
create/resize time and never a SIGBUS when a page is first touched later.

    seg = ShmSegment.create("job42", "rank0-snap", nbytes)
    seg.tensor()[:n].copy_(...)           # or CopyEngine into seg.tensor()
    # ... process killed, restarted ...
    seg = ShmSegment.attach("job42", "rank0-snap")
    ShmSegment.remove_job("job42")        # when the job is over

Views returned by ``tensor()`` keep their mapping alive (``close``/``resize``
never unmap memory under a live tensor); ``resize`` to a smaller size refuses
while any view exists (such a view would SIGBUS past the new end).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat

import numpy as np
import torch

from reft_ext import _native, safe_dir
from reft_ext.store import paths
from reft_ext.store.paths import check_name as _check_name
from reft_ext.store.paths import job_dir
from reft_ext.testing import fault_point  # tests: --inject-fault ...:shm-full (no-op otherwise)

log = logging.getLogger("reft")

# Pages are faulted in when a segment is mapped, so that no snapshot pays a fault per
# page. mmap.mmap(..., MAP_POPULATE) does that holding the GIL (0.36-0.44 s per GB on
# this host, so a rank whose slots a background thread maps stalled its training thread
# as long); madvise(MADV_POPULATE_WRITE) through ctypes, which drops the GIL for the
# call, does the same beside it (Linux >= 5.14; Python 3.11's mmap lacks the name)
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


_POPULATE_CHUNK = 64 << 20


def _populate(mm: mmap.mmap) -> bool:
    """Fault in every page of ``mm`` writable without holding the GIL; False where the
    kernel lacks MADV_POPULATE_WRITE. In 64 MiB calls: each holds the process's mmap
    lock, which another thread's mmap/munmap (a large tensor's allocation) waits for,
    and its page faults behind that; beside a 1.5 GB populate a 32 MB allocation took
    up to 47 ms in one call, 26 ms in chunks (this host)."""
    n = len(mm)
    view = (ctypes.c_char * n).from_buffer(mm)
    try:
        base = ctypes.addressof(view)
        for off in range(0, n, _POPULATE_CHUNK):
            if _libc.madvise(base + off, min(_POPULATE_CHUNK, n - off),
                             _MADV_POPULATE_WRITE) != 0:
                return False
        return True
    finally:
        del view  # the buffer export: mm can be closed again


class ShmSpaceError(OSError):
    """Not enough free space on the shared-memory filesystem."""

    def __str__(self) -> str:  # the one-line message, without "[Errno 28]"
        return self.strerror or super().__str__()


class ShmDirError(PermissionError):
    """The job's shared-memory directory is not this user's private directory."""

    __str__ = ShmSpaceError.__str__


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _space_error(path: str, need: int, free: int) -> ShmSpaceError:
    return ShmSpaceError(
        errno.ENOSPC,
        f"shared-memory segment {path} needs {need} more bytes ({_human(need)}) but its "
        f"filesystem has {free} bytes ({_human(free)}) free; lower the snapshot footprint "
        f"(--reft-keep, --reft-protect; --reft-host-memory-limit checks it per node at "
        f"start) or point --reft-shm-dir at a larger tmpfs "
        f"(e.g. a bigger /dev/shm: docker --shm-size, mount -o remount,size=...)")


def check_space(path: str, need: int) -> None:
    """ShmSpaceError now if ``path``'s filesystem has less than ``need`` bytes free."""
    free = _free_bytes(os.path.dirname(path))
    if need > free:
        raise _space_error(path, need, free)


def _reserve(fd: int, path: str, offset: int, length: int) -> None:
    """Grows the file to offset+length with its pages really allocated."""
    if length <= 0:
        return
    check_space(path, length)
    try:
        fault_point("shm-reserve", path=path, length=length)  # an injected ENOSPC (tests)
        os.posix_fallocate(fd, offset, length)  # tmpfs allocates the pages now
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG):  # lost a race for the space
            raise _space_error(path, length, _free_bytes(os.path.dirname(path))) from exc
        raise


def ensure_private_dir(path: str) -> None:
    """Create the job's directory, or take an existing one only if it is this user's:
    a directory of another user (another job with the same id, or a planted one) is
    never written into, and the error says what to do. Opened from / one directory at a
    time (reft_ext/safe_dir.py): one below a directory another user could swap
    (a --reft-shm-dir of theirs) is refused too."""
    what = "Start this job with another --reft-job-id (or --reft-shm-dir), or remove " \
        f"{path} if the job that made it is over"
    try:
        d = safe_dir.open_dir(path, create=True, fix_mode=True)
    except NotADirectoryError:
        raise ShmDirError(errno.ENOTDIR, f"--reft-shm-dir: {path} exists and is not a "
                          f"directory. {what}") from None
    except safe_dir.UnsafePathError as exc:
        held = " another job or user holds this --reft-job-id on this node." \
            if exc.component == exc.path and exc.why.startswith("belongs to") else ""
        raise ShmDirError(errno.EACCES, f"--reft-shm-dir: {path} {exc.reason}:{held} "
                          f"{what}") from None
    with d:
        if stat.S_IMODE(os.fstat(d.fd).st_mode) != 0o700:
            os.fchmod(d.fd, 0o700)


class ShmSegment:
    """One named segment; use :meth:`create` or :meth:`attach`, not the constructor."""

    def __init__(self, path: str, fd: int, nbytes: int, job_id: str, name: str):
        self.path, self.job_id, self.name = path, job_id, name
        self._fd: int | None = fd
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = None
        self._retired: list[mmap.mmap] = []  # older mappings that live views still use
        self._pinned_ptr: int | None = None
        self._pinned_device: int | None = None  # the device it was locked with
        self._map()

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, job_id: str, name: str, nbytes: int, *, base_dir: str | None = None,
               pin: bool = False) -> ShmSegment:
        """New segment of nbytes (FileExistsError if the name is taken)."""
        _check_name(name, "name")
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        d = job_dir(job_id, base_dir)
        parent = paths.parent_of(job_id, base_dir)
        if parent is not None:  # the job's private parent first (reft_ext/store/paths.py)
            ensure_private_dir(parent)
        ensure_private_dir(d)
        path = os.path.join(d, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            _reserve(fd, path, 0, int(nbytes))
            seg = cls(path, fd, int(nbytes), job_id, name)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if pin:
            seg.pin()
        return seg

    @classmethod
    def attach(cls, job_id: str, name: str, *, base_dir: str | None = None,
               pin: bool = False) -> ShmSegment:
        """Maps an existing segment (e.g. after a restart); FileNotFoundError if absent."""
        _check_name(name, "name")
        path = os.path.join(job_dir(job_id, base_dir), name)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise PermissionError(f"{path}: not a private (0600, own uid) REFT segment")
            seg = cls(path, fd, st.st_size, job_id, name)
        except BaseException:
            os.close(fd)
            raise
        if pin:
            seg.pin()
        return seg

    @staticmethod
    def exists(job_id: str, name: str, *, base_dir: str | None = None) -> bool:
        _check_name(name, "name")
        return os.path.isfile(os.path.join(job_dir(job_id, base_dir), name))

    @staticmethod
    def list(job_id: str, *, base_dir: str | None = None) -> list[str]:
        d = job_dir(job_id, base_dir)
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    @staticmethod
    def remove_job(job_id: str, *, base_dir: str | None = None) -> None:
        """Deletes every segment of the job and its directory (end of job / tests)."""
        d = job_dir(job_id, base_dir)
        # the ranks of one node may all get here at once: whoever is first wins
        for n in ShmSegment.list(job_id, base_dir=base_dir):
            try:
                os.unlink(os.path.join(d, n))
            except FileNotFoundError:
                pass
        for empty in (d, paths.parent_of(job_id, base_dir)):
            try:
                if empty is not None:
                    os.rmdir(empty)
            except (FileNotFoundError, OSError):
                break  # gone, or another rank (or node) still has files there

    def close(self) -> None:
        """Unmaps and closes this process's handle; the segment itself stays."""
        self.unpin()
        self._unmap(strict=False)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def fileno(self) -> int:
        """The open file of the segment (ValueError once closed)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: closed")
        return self._fd

    def unlink(self) -> None:
        """Closes and removes the segment (and the job directory once empty)."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass  # other segments remain

    def resize(self, nbytes: int) -> None:
        """Grows (space checked and reserved) or shrinks the segment and remaps it.

        Growing keeps older views valid (they map the old, still-present prefix).
        Shrinking raises RuntimeError while views exist."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if self._fd is None:
            raise RuntimeError("segment is closed")
        if nbytes == self.nbytes:
            return
        was_pinned = self._pinned_ptr is not None
        self.unpin()
        if nbytes < self.nbytes:
            try:
                self._unmap(strict=True)
            except RuntimeError:
                if was_pinned:
                    self.pin()
                raise
            os.ftruncate(self._fd, nbytes)
        else:
            _reserve(self._fd, self.path, self.nbytes, nbytes - self.nbytes)
            self._unmap(strict=False)
        self.nbytes = nbytes
        self._map()
        if was_pinned:
            self.pin()

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------ access
    def tensor(self, dtype: torch.dtype = torch.uint8, offset: int = 0,
               count: int = -1) -> torch.Tensor:
        """Zero-copy 1-D view of the segment (bytes [offset, offset+count*itemsize))."""
        if self._fd is None:
            raise RuntimeError("segment is closed")
        item = torch.empty((), dtype=dtype).element_size()
        if count < 0:
            count = (self.nbytes - offset) // item
        if offset < 0 or offset + count * item > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + count * item}) outside {self.nbytes} bytes")
        if count == 0 or self._mm is None:
            return torch.empty(0, dtype=dtype)
        # Not torch.frombuffer: it drops the buffer export, so the mapping could be
        # unmapped (close/resize) under a live tensor.  A numpy view holds the
        # export, and the tensor holds the numpy array, for as long as it lives.
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=count * item, offset=offset)
        return torch.from_numpy(arr).view(dtype)

    @property
    def pinned(self) -> bool:
        return self._pinned_ptr is not None

    def pin(self, device: int | None = None) -> bool:
        """Page-locks the mapping for async device->host copies; False without CUDA.
        ``device``: current for the registration (the rank's: a thread's own is 0, and
        the registration would make a context on GPU 0); None: the thread's. The page-
        locking thread (store/slots.py) sets the rank's device itself first."""
        if self._pinned_ptr is not None:
            return True
        if self._mm is None or not torch.cuda.is_available():
            return False
        ptr = self.tensor().data_ptr()
        # whole pages (the mapping has them): a length that is not a page multiple is
        # refused by some drivers
        n = -(-max(self.nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        # ``device`` current for the call through torch's guard, which restores the
        # thread's previous device only where that one has a context (a restore to a
        # new thread's device 0 would make one there); the native call sets none
        with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
            if _native.C is not None and _native.HAVE_NATIVE_CUDA:
                _native.C.cuda_host_register(ptr, n, -1)
                rc = 0
            else:
                rc = torch.cuda.cudart().cudaHostRegister(ptr, n, 1)  # 1 = Portable
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister({self.path}, {n}) failed: {rc}")
        self._pinned_ptr = ptr
        self._pinned_device = device
        return True

    def unpin(self) -> None:
        if self._pinned_ptr is None:
            return
        ptr, self._pinned_ptr = self._pinned_ptr, None
        dev = self._pinned_device
        with torch.cuda.device(dev if dev is not None else torch.cuda.current_device()):
            if _native.C is not None and _native.HAVE_NATIVE_CUDA:
                _native.C.cuda_host_unregister(ptr)
            else:
                torch.cuda.cudart().cudaHostUnregister(ptr)

    # ------------------------------------------------------------ mapping
    def _map(self) -> None:
        if self.nbytes == 0:
            self._mm = None
            return
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self._mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED, prot=prot)
        if not _populate(self._mm):  # an older kernel: the flag, GIL held (see _populate)
            self._mm.close()
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(self._fd, self.nbytes, flags=flags, prot=prot)

    def _unmap(self, strict: bool) -> None:
        """Drops the current mapping.  Mappings that live views still use are kept
        (they are unmapped when the last view dies); strict=True raises instead when
        any mapping of this object, current or retired, still has views."""

        def try_close(mm) -> bool:
            try:
                mm.close()
                return True
            except BufferError:
                return False

        self._retired = [mm for mm in self._retired if not try_close(mm)]
        cur_alive = self._mm is not None and not try_close(self._mm)
        if strict and (cur_alive or self._retired):
            if not cur_alive:  # the current one was closed: restore it
                self._mm = None
                self._map()
            raise RuntimeError(f"{self.path}: tensor views of the segment are still alive; "
                               "drop them before shrinking it")
        if cur_alive:
            log.debug("[REFT] %s: mapping kept alive by tensor views", self.path)
            self._retired.append(self._mm)
        self._mm = None

    def __repr__(self) -> str:
        return f"ShmSegment({self.path!r}, nbytes={self.nbytes}, pinned={self.pinned})"
