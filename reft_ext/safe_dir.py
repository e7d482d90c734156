"""Directories opened from a safe root, one component at a time (the one helper for every
place REFT and the trainer read or write by name: the dataset cache, the flush and log
directories, --save/--load, the places in /tmp and /dev/shm).

A path checked by name and then looked up again by name is only as safe as every
directory above it: whoever can rename an entry of an ancestor (another user's
directory, one writable by group or others) can swap the checked directory for their own
between the check and the open (``renameat2(RENAME_EXCHANGE)``). So :func:`open_dir`
walks from ``/``: each component is opened ``O_NOFOLLOW|O_DIRECTORY`` relative to its
parent's descriptor and checked on that descriptor (``fstat``): an ancestor must be this
user's or root's and not writable by group or others, or sticky (``/tmp``,
``/dev/shm``: then only the owner of an entry can rename it, and the entry below must be
this user's or root's). The last component must be what the caller asks for
(:data:`PRIVATE`: this user's, not writable by group or others; :data:`TRUSTED`: this
user's or root's, not writable by group or others; :data:`PARENT`: as an ancestor, for
a directory in which this user's own is to be made). A symbolic link on the way is followed only
where just this user or root could have made it (the link theirs, in a directory no one
else can write, or theirs in a sticky one); the last component is never a link.

The result holds the checked directory's descriptor: files are opened through it
(:meth:`SafeDir.open`, ``dir_fd=``), and code that only takes a path (megatron-core's
dataset cache) is given :attr:`SafeDir.proc_path`, ``/proc/self/fd/<fd>``, which the
kernel resolves to the held directory itself: a swap after the check changes nothing.
Plain Python (no torch).
"""

from __future__ import annotations

import errno
import os
import stat

PRIVATE, TRUSTED, PARENT = "private", "trusted", "parent"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's path walk (ELOOP)


class UnsafePathError(PermissionError):
    """A directory (or one above it) that another user could write or swap: refused.
    ``path``: the directory asked for; ``component``: the one that failed; ``why``: what
    is wrong with it (``is a symbolic link``, ``belongs to uid 1002, ...``)."""

    def __init__(self, path: str, component: str, why: str, message: str = ""):
        self.path, self.component, self.why = path, component, why
        super().__init__(errno.EACCES, message or describe(path, component, why))

    def __str__(self) -> str:  # the one-line message, without "[Errno 13]"
        return self.strerror or super().__str__()

    @property
    def reason(self) -> str:
        """The message without the path in front (``is a symbolic link ...``)."""
        return reason(self.path, self.component, self.why)


def reason(path: str, component: str, why: str) -> str:
    """What is wrong with ``path``: ``why`` itself, or that of the ancestor ``component``."""
    if component == path:
        return why
    return (f"is below {component}, which {why} (whoever can write it could swap what "
            f"is below it after any check)")


def describe(path: str, component: str, why: str) -> str:
    return f"{path} {reason(path, component, why)}"


def _owner_problem(st: os.stat_result, owners: tuple[int, ...]) -> str | None:
    if st.st_uid not in owners:
        return (f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
                + (" or root" if 0 in owners and os.geteuid() != 0 else ""))
    return None


def _writable_problem(st: os.stat_result) -> str:
    return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"


def _ancestor_problem(st: os.stat_result) -> str | None:
    """An ancestor: this user's or root's, and either not writable by group or others,
    or sticky (the entry below is then checked to be this user's or root's)."""
    why = _owner_problem(st, (os.geteuid(), 0))
    if why is None and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        why = _writable_problem(st)
    return why


def _final_problem(st: os.stat_result, kind: str) -> str | None:
    if kind == PARENT:  # where a directory of this user's is to be made: as above
        return _ancestor_problem(st)
    why = _owner_problem(st, (os.geteuid(),) if kind == PRIVATE else (os.geteuid(), 0))
    if why is None and st.st_mode & 0o022:
        why = _writable_problem(st)
    return why


class SafeDir:
    """A checked directory held open: ``fd``, ``path`` (its absolute name, links
    resolved), :attr:`proc_path`. Close it (or use ``with``) unless it is kept for the
    process's life."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    @property
    def proc_path(self) -> str:
        """``/proc/self/fd/<fd>``: the held directory by a name no rename can redirect
        (for code that takes a path; valid while the descriptor is open, in this process
        and in children forked from it)."""
        return f"/proc/self/fd/{self.fd}"

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of an entry of this directory, never through a link (a plain
        name: no ``/``)."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} is not a plain file name")
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def subdir(self, name: str, *, create: bool = False, mode: int = 0o700,
               kind: str = PRIVATE) -> "SafeDir":
        """A directory entry of this one (a plain name), opened through this one's
        descriptor and checked as the last component of a walk."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} is not a plain directory name")
        return _walk(os.path.join(self.path, name), kind, create, mode, start=(self, name))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SafeDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dir(path: str, *, kind: str = PRIVATE, create: bool = False,
             mode: int = 0o700, fix_mode: bool = False) -> SafeDir:
    """Walk ``path`` from ``/`` (relative: from the working directory's absolute name),
    each component opened through its parent's descriptor and checked (module doc).
    ``create``: missing components are made (``mkdirat``; ``mode`` for the last, 0755 for
    those above it). ``fix_mode``: a last component of this user's that is writable by
    group or others is made ``mode`` instead of refused. :class:`UnsafePathError` (a
    one-line message naming the component and what is wrong with it),
    ``FileNotFoundError`` or ``NotADirectoryError`` otherwise."""
    if kind not in (PRIVATE, TRUSTED, PARENT):
        raise ValueError(f"kind {kind!r}")
    return _walk(os.path.abspath(path), kind, create, mode, fix_mode=fix_mode)


def open_file(path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
              mode: int = 0o600, *, kind: str = PRIVATE) -> int:
    """``os.open`` of ``path`` through its directory's checked descriptor
    (:func:`open_dir`, the directory as ``kind``), never through a link (``O_NOFOLLOW``):
    a log or record in a directory of this user's. :class:`UnsafePathError` for the
    directory; ``OSError`` (``ELOOP`` for a link) for the file."""
    with open_dir(os.path.dirname(os.path.abspath(path)), kind=kind) as d:
        return d.open(os.path.basename(path), flags, mode)


def problem(path: str, *, kind: str = PRIVATE) -> str | None:
    """What :func:`open_dir` would refuse ``path`` for (``does not exist`` when a
    component is missing), or None; nothing is created or kept open."""
    try:
        open_dir(path, kind=kind).close()
    except UnsafePathError as exc:
        return exc.reason
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "is not a directory"
    return None


def _walk(path: str, kind: str, create: bool, mode: int,
          start: tuple[SafeDir, str] | None = None, fix_mode: bool = False) -> SafeDir:
    asked, links = path, 0
    while True:  # once per symbolic link followed: the walk starts again at its target
        if start is not None:  # a subdir: the parent is held and was checked already
            parent, parts, done = start[0], [start[1]], start[0].path
            fd = os.dup(parent.fd)
        else:
            parts, done = [p for p in path.split("/") if p], "/"
            fd = os.open("/", _DIR_FLAGS)
        restart = None
        try:
            st = os.fstat(fd)
            if start is None and not parts:
                why = _final_problem(st, kind)
                if why:
                    raise UnsafePathError(asked, "/", why)
                return SafeDir(os.dup(fd), "/")
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                if name == "..":  # lexical: every directory walked so far is a real one
                    raise UnsafePathError(asked, done, "has '..' below it")
                why = _ancestor_problem(st) if not (start is not None and i == 0) else None
                if why:
                    raise UnsafePathError(asked, done, why)
                here = os.path.join(done, name)
                nfd = _open_component(fd, name, here, asked, last, create, mode)
                if isinstance(nfd, str):  # a link that may be followed: its target
                    lst = os.lstat(name, dir_fd=fd)
                    if lst.st_uid not in (os.geteuid(), 0):  # (in a sticky one: theirs)
                        raise UnsafePathError(asked, here, "is a symbolic link of uid "
                                              f"{lst.st_uid} (another user's)")
                    links += 1
                    if links > _MAX_LINKS:
                        raise UnsafePathError(asked, here, "has too many symbolic links")
                    restart = os.path.normpath(os.path.join(done, nfd, *parts[i + 1:]))
                    break
                os.close(fd)
                fd, done = nfd, here
                st = os.fstat(fd)  # an entry of a sticky directory: its owner checked next
            if restart is None:
                why = _final_problem(st, kind)
                if why and fix_mode and st.st_uid == os.geteuid():
                    os.fchmod(fd, mode)
                    why = _final_problem(os.fstat(fd), kind)
                if why:
                    raise UnsafePathError(asked, done, why)
                out, fd = SafeDir(fd, done), -1
                return out
        finally:
            if fd >= 0:
                os.close(fd)
        path, start = restart, None


def _open_component(fd: int, name: str, here: str, asked: str, last: bool, create: bool,
                    mode: int):
    """The descriptor of directory ``name`` in ``fd`` (made if ``create``), or the target
    of a symbolic link there (a str) when one may be followed (not the last component)."""
    for attempt in (0, 1):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create or attempt:
                raise FileNotFoundError(errno.ENOENT, f"{here} does not exist", here)
            try:
                os.mkdir(name, mode if last else 0o755, dir_fd=fd)
            except FileExistsError:
                pass  # made meanwhile (another rank): checked as any other
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            lst = os.lstat(name, dir_fd=fd)
            if not stat.S_ISLNK(lst.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{here} is not a directory",
                                         here) from None
            if last:
                target = os.readlink(name, dir_fd=fd)
                raise UnsafePathError(asked, here, f"is a symbolic link (to {target})")
            return os.readlink(name, dir_fd=fd)
    raise AssertionError("unreachable")
