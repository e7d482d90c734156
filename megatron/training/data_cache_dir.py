"""The private directory megatron-core's dataset index cache lives in, and the data locks.

megatron-core loads its cached index files with np.load(allow_pickle=True): whoever can write
(or swap) the cache directory can run code as the training user. So the cache root is the
job's own (default_data_cache_root, never a fixed name in the shared temp dir), every
directory from / down to it is checked (reft_ext/safe_dir.py) and refused with one line
naming it (UnsafeCacheDirError), and megatron-core is handed /proc/self/fd/<fd> of the
checked directory, held open, so a directory swapped after the check changes nothing.

Also here: the per-machine file locks (_file_lock) the data preparation takes in that root,
and the content fingerprint that names the cache subdirectory of a dataset (data_cache_path).
Split out of data.py, which builds the datasets in this directory.
"""

import contextlib
import errno
import fcntl
import hashlib
import os
from typing import List, Optional

from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

from reft_ext import safe_dir


def default_data_cache_root() -> str:
    """The job's own cache root: $XDG_CACHE_HOME/reft-megatron/data-cache, or
    ~/.cache/reft-megatron/data-cache. Never a fixed name in the shared temp dir: megatron-core
    loads the cached index files with np.load(allow_pickle=True), so whoever can write the cache
    directory can run code as the training user."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "reft-megatron", "data-cache")


class UnsafeCacheDirError(ValueError):
    """A cache/lock directory another user could write or swap (a symlink, another user's,
    writable by group/others, or below such a directory): refused."""


def _open_private(path: str, what: str) -> safe_dir.SafeDir:
    """`path` opened from / one directory at a time (reft_ext/safe_dir.py), created
    0700 if missing: this user's, not writable by group/others, not a symlink, and below
    directories nobody else can write or swap. UnsafeCacheDirError with a one-line message
    naming it otherwise. Safe to call from many processes at once."""
    path = os.path.abspath(path)
    lock = what.startswith("lock")
    fix = ("remove it or set XDG_CACHE_HOME to a directory you own" if lock
           else "choose another --data-cache-path (or remove it)")
    try:
        return safe_dir.open_dir(path, create=True)
    except safe_dir.UnsafePathError as exc:
        why = exc.reason
        if exc.component == path and "writable by group or others" in why:
            fix = f"chmod 700 {path} or {fix}"
    except NotADirectoryError:
        why = "is not a directory (or a directory above it is not)"
    risk = ("another user could plant files there" if lock else
            "megatron-core loads pickled index files from it, so another user who can write "
            "or swap it could run code as you")
    raise UnsafeCacheDirError(f"refusing {what} {path}: it {why}; {fix} ({risk})")


def private_dir(path: str, what: str = "data cache directory") -> str:
    """Create `path` (mode 0700) if missing and return its absolute path, after checking it
    and every directory above it (_open_private). For a check; code that reads or writes
    there takes the held directory (_held_dir), not this name."""
    _open_private(path, what).close()
    return os.path.abspath(path)


_held: dict = {}  # (absolute path, subdirectory) -> SafeDir, open for the process's life


def _held_dir(path: str, sub: Optional[str] = None) -> str:
    """`path` (and its subdirectory `sub`), checked as private_dir does and held open for
    the life of the process; returns /proc/self/fd/<fd>, a name of the checked directory
    itself: megatron-core opens its cached index files by name, and through this one a
    directory renamed or swapped after the check (renameat2 RENAME_EXCHANGE) changes
    nothing. The same name every time in one process (the dataset cache's key,
    dataset_cache.py); forked DataLoader workers inherit the descriptor."""
    key = (os.path.abspath(path), sub)
    if key not in _held:
        d = _open_private(path, "data cache directory")
        if sub is not None:
            with d:  # (the parent: closed once its subdirectory is held)
                try:
                    d = d.subdir(sub, create=True)
                except safe_dir.UnsafePathError as exc:
                    raise UnsafeCacheDirError(
                        f"refusing data cache directory {exc.path}: it {exc.reason}; remove "
                        f"it (megatron-core loads pickled index files from it)") from None
        _held[key] = d
    return _held[key].proc_path


def data_cache_path_error(path: Optional[str]) -> Optional[str]:
    """What is wrong with --data-cache-path (or, when None, the default cache root), or None.
    One line, for argument validation: the same check the dataset builder makes on every rank."""
    try:
        private_dir(path or default_data_cache_root())
    except (UnsafeCacheDirError, OSError) as e:
        return str(e)
    return None


@contextlib.contextmanager
def _file_lock(name: str):
    """Inter-process lock (one per machine) in the user's private cache directory
    (<default_data_cache_root()>/.locks, 0700, opened from / as private_dir checks it); needs
    no torch.distributed, so any subset of ranks, or separate jobs, can call the functions
    that use it. Opened through the checked directory's descriptor with O_NOFOLLOW: a symlink
    planted at the lock path is never followed."""
    root = default_data_cache_root()
    with _open_private(root, "data cache directory") as top:
        try:
            locks = top.subdir(".locks", create=True)
        except safe_dir.UnsafePathError as exc:
            raise UnsafeCacheDirError(
                f"refusing lock directory {exc.path}: it {exc.reason}; remove it or set "
                f"XDG_CACHE_HOME to a directory you own (another user could plant files "
                f"there)") from None
    path = os.path.join(locks.path, f"megatron_data_{name}.lock")
    try:
        fd = locks.open(os.path.basename(path), os.O_RDWR | os.O_CREAT)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCacheDirError(
                f"refusing lock file {path}: it is a symlink; remove it") from None
        raise
    finally:
        locks.close()
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



def _data_fingerprint(prefixes: List[str]) -> str:
    """Content hash of the indexed datasets (.idx bytes, .bin size). megatron-core's cache names
    hash the prefix path but not the data, so a corpus rebuilt under the same prefix would reuse
    stale indices; keying the cache directory by content prevents that. Path-free, so ranks that
    mount the data at different paths still agree."""
    h = hashlib.sha1()
    for p in prefixes:
        h.update(str(os.path.getsize(get_bin_path(p))).encode())
        with open(get_idx_path(p), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def data_cache_path(args, prefixes: List[str]) -> str:
    """<args.data_cache_path or default_data_cache_root()>/<data fingerprint>, both checked as
    private_dir does (created 0700; refused when a symlink, another user's, writable by
    group/others, or below a directory another user could swap) and returned as the held
    directory's /proc/self/fd name (_held_dir). Must be one directory every rank sees (shared
    FS for multi-node): rank 0 writes, then the others read after the builder's barrier."""
    root = getattr(args, "data_cache_path", None) or default_data_cache_root()
    return _held_dir(root, _data_fingerprint(prefixes))
