"""Small helpers shared by the trainer: rank-filtered printing, process timing."""

from __future__ import annotations

import os
import sys
import time

import torch


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def emit(msg: str) -> None:
    """One line in one write: ranks share torchrun's stdout pipe, and print() writes the
    text and its newline separately (unbuffered), so two ranks' lines could run together."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def print_rank_0(msg: str) -> None:
    if _rank() == 0:
        emit(msg)


def print_rank_last(msg: str) -> None:
    """The last rank sits on the last pipeline stage, where the loss is."""
    if _rank() == _world() - 1:
        print(msg, flush=True)


def is_last_rank() -> bool:
    return _rank() == _world() - 1


def process_start_time() -> float:
    """Wall-clock time at which this process started (for start-up latency figures); a
    warm spare's (reft_ext/cluster/spare.py) life as a rank starts at its assignment."""
    if os.environ.get("REFT_WARM_START"):
        return float(os.environ["REFT_WARM_START"])
    # now less the process's age, both from the kernel's uptime clock (10 ms ticks):
    # psutil's create_time adds the age to /proc/stat's btime, whole seconds, up to 1 s
    # early (goodput then booked a restarted process's start before its predecessor's
    # last record: no detection, no restore)
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux: the import time is close
        return _IMPORT_TIME


_IMPORT_TIME = time.time()
