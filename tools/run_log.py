"""`make run`'s tee: the run directory made safely, the log written without following a link.

    python tools/run_log.py --mkdir RUN_DIR           # made (0700) or refused, one line
    CMD 2>&1 | python tools/run_log.py RUN_DIR/train.log

``tee`` opened ``train.log`` by name: in a RUN_DIR another user made, a ``train.log``
planted as a link to a file of the job's user was overwritten before the trainer's own
checks refused the run (issue 60). Here RUN_DIR is opened from ``/`` one component at a
time and must be this user's (reft_ext/safe_dir.py; made 0700 when missing), and the log
is opened through that directory's descriptor with ``O_NOFOLLOW`` (a link fails with
one line, nothing written). Ctrl-C reaches every process of the terminal's foreground
group: this one ignores SIGINT (and SIGTERM) and copies until the job closes the pipe,
so the lines the job prints while it stops (the flush that saved the work, the
host-memory note) are kept in the log and on the terminal.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reft_ext import safe_dir  # noqa: E402

ADVICE = "give a RUN_DIR of this user's that only this user can write (e.g. runs/default)"


def open_run_dir(path: str) -> safe_dir.SafeDir:
    """RUN_DIR made (0700) or taken only when it is this user's, below safe directories;
    SystemExit with one line otherwise."""
    try:
        return safe_dir.open_dir(path, create=True)
    except safe_dir.UnsafePathError as exc:
        raise SystemExit(f"error: RUN_DIR: {path} {exc.reason}: not used; {ADVICE}") from None
    except (NotADirectoryError, FileNotFoundError, PermissionError) as exc:
        raise SystemExit(f"error: RUN_DIR: {path}: {exc.strerror or exc}; {ADVICE}") from None


def open_log(path: str) -> int:
    """The log file, through its checked directory, never through a link (truncated, as
    tee's)."""
    with open_run_dir(os.path.dirname(os.path.abspath(path))) as d:
        try:
            return d.open(os.path.basename(path),
                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            what = "is a symbolic link" if os.path.islink(path) else exc.strerror
            raise SystemExit(f"error: {path} {what}: not written; {ADVICE}") from None


def tee(fd: int, src=None, out=None) -> None:
    src = src or sys.stdin.buffer
    out = out or sys.stdout.buffer
    while True:
        chunk = src.read1(1 << 16) if hasattr(src, "read1") else src.read(1 << 16)
        if not chunk:
            return
        os.write(fd, chunk)
        try:
            out.write(chunk)
            out.flush()
        except (BrokenPipeError, OSError):
            out = open(os.devnull, "wb")  # the terminal gone: the log still gets it all


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --mkdir DIR | %(prog)s LOGFILE (stdin to both)")
    p.add_argument("--mkdir", metavar="DIR", help="make DIR (0700) or refuse it, and exit")
    p.add_argument("log", nargs="?", help="the log file, in a directory of this user's")
    a = p.parse_args(argv)
    if a.mkdir:
        open_run_dir(a.mkdir).close()
        return 0
    if not a.log:
        p.error("give --mkdir DIR or the log file")
    fd = open_log(a.log)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the job's last lines come after Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        tee(fd)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
