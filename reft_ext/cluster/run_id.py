"""The default job id of a launch: one per run, kept in the run's checkpoint directory.

A job's host memory is found by its job id (``<shm>/reft-<job>``, reft_ext/store/paths.py).
A fresh random id per launch never finds the memory of the launch before it (a re-run
after Ctrl-C, SIGTERM or a crash starts from the flushed tier at best, and the old
segments stay); a fixed one per directory could be guessed by another user, who would
make ``<shm>/reft-<job>`` first. So the id is random (``run-`` and 16 hex digits), made
once and kept in ``<--save>/reft-job-id``, a 0600 file of the run's private checkpoint
directory, and read back by the next launch of the same run while its host memory is
there. When this user's ``<shm>/reft-<id>`` is absent (nothing to find: a normal end
removed it) or is not this user's own (made by someone who read the id), the launch
takes a fresh id: a name seen once in a listing of /dev/shm is never made again.

Used by ``python -m reft_ext.cluster.torchrun --standalone`` and tools/launch_nodes.py;
an explicit --rdzv-id, --job-id or --reft-job-id is kept as given. Plain Python.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

from reft_ext import safe_dir
from reft_ext.store import paths

FILE = "reft-job-id"
_ID_RE = re.compile(r"run-[0-9a-f]{16}")


def script_flag(script_args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a training script's arguments (``--f v`` or ``--f=v``;
    the last one wins, as argparse's)."""
    value = None
    for i, a in enumerate(script_args):
        if a == flag and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def fresh() -> str:
    return f"run-{secrets.token_hex(8)}"


def _own_memory(shm_dir: str, job: str) -> bool:
    """This user's private ``<shm>/reft-<job>`` exists (host memory a re-run can use)."""
    return safe_dir.problem(paths.job_parent(shm_dir, job)) is None


def for_run(save_dir: str | None, shm_dir: str | None = None) -> tuple[str, str]:
    """(job id, what it is) for a launch whose trainer saves to ``save_dir``: the id kept
    there while its host memory is there, else a fresh one written there. Without a
    --save, or with one this user cannot keep a private file in (the trainer refuses
    such a --save by name): a fresh id, not kept."""
    shm_dir = shm_dir or paths.default_base_dir()
    if not save_dir:
        return fresh(), "new (no --save to keep it in)"
    try:
        d = safe_dir.open_dir(save_dir, create=True)
    except (OSError, ValueError):
        return fresh(), f"new (--save {save_dir} is not this user's private directory)"
    with d:
        kept = _read(d)
        if kept and _own_memory(shm_dir, kept):
            return kept, f"kept in {os.path.join(save_dir, FILE)} (its host memory is there)"
        job = fresh()
        try:
            tmp = f".{FILE}.{secrets.token_hex(4)}"
            fd = d.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(job + "\n")
            os.rename(tmp, FILE, src_dir_fd=d.fd, dst_dir_fd=d.fd)
        except OSError as exc:
            return job, f"new (not kept: {exc.strerror} in {save_dir})"
        return job, f"new, kept in {os.path.join(save_dir, FILE)}"


def _read(d: safe_dir.SafeDir) -> str | None:
    """The id in the directory's file, if it is this user's own regular file of one id."""
    try:
        fd = d.open(FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        text = f.read(64).strip()
    return text if _ID_RE.fullmatch(text) else None


def for_script(script_args: list[str]) -> tuple[str, str]:
    """:func:`for_run` with --save (else --load) and --reft-shm-dir read from the
    training script's arguments."""
    save = script_flag(script_args, "--save") or script_flag(script_args, "--load")
    return for_run(save, script_flag(script_args, "--reft-shm-dir"))
