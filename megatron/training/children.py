"""Processes a rank forks die with it.

megatron-core forks from a training rank: the async-save writer, the bucket writers of
``write_preloaded_data_multiproc`` (a synchronous save too), a fork-context results-queue
manager (checkpointing.py). A fork shares the rank's mappings - its /dev/shm snapshot
slots and heartbeat among them - and its stdout. Left behind by a SIGKILLed rank (found
by tools/chaos.py: parent 1, blocked in a futex for 10+ minutes), it keeps writing a
checkpoint nobody will finalize, keeps the job's output open (torchrun and any harness
reading it to the end wait), and pins the deleted tmpfs pages of the dead rank.

:func:`install` registers a fork hook: every child the rank forks through Python
(``os.fork``, multiprocessing's fork context; not ``subprocess``, which execs - the node
watcher must outlive its rank to flush) asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG), and exits at once if the parent died before that took effect.
Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_parent: int | None = None
_installed = False


def die_with_parent() -> None:
    """In a child: SIGKILL when the process that forked it ends. Forks come from the
    rank's main thread, whose end is the process's end (PDEATHSIG follows the thread)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _before() -> None:
    global _parent
    _parent = os.getpid()


def _after_in_child() -> None:
    die_with_parent()
    if _parent is not None and os.getppid() != _parent:  # the parent died first
        os._exit(1)


def install() -> None:
    """Once per process (children inherit the hook: a writer's own writers die with it)."""
    global _installed
    if not _installed and sys.platform.startswith("linux"):
        os.register_at_fork(before=_before, after_in_child=_after_in_child)
        _installed = True


def die_with_launcher() -> None:
    """A rank started by a torchrun agent (its parent) is SIGKILLed when the agent ends.
    The agent starts its workers in sessions of their own: after a SIGKILL of the
    launcher they trained on as orphans, beside the re-run that should resume from the
    host memory they still held (issue 59). Their node's watcher flushes as after any
    death of the ranks."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return
    if b"torchrun" not in cmd and b"torch.distributed.run" not in cmd:
        return  # not a torchrun agent (the in-process pool sets its own: cluster/spare.py)
    die_with_parent()
    if os.getppid() != agent:  # the agent died before the prctl took effect
        os._exit(1)
