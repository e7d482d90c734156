"""The flushed tier: snapshots a node's watcher copied to ``--reft-flush-dir`` when its
workers died (reft_ext/cluster/watcher.py), read back at REFT-load.

It sits between host memory and the persistent checkpoint. Rather than a second recovery
path, the flushed slots of a rank are put back into its shared-memory store when they are
newer than what the store holds (a job restarted from scratch, a replaced node): REFT-load
then treats them exactly as host memory, so the same checksum verification (a torn or
corrupt file is never loaded), the same job-wide planning (newest iteration every sharding
group can rebuild wins) and the same comparison with ``--load`` apply. A slot is committed
here only where the flushed commit pointer names it: without one, the imported slots stay
uncommitted, as in memory after a torn pointer (the other ranks' commits decide).
"""

from __future__ import annotations

import glob
import os
import re

from reft_ext.report.events import reft_print
from reft_ext.store import paths
from reft_ext.store.slots import SnapshotStore, read_sealed

_reported: set = set()  # (path, why): one line per bad flushed file


def _read(path: str) -> dict | None:
    """A flushed manifest or commit pointer, if whole (its own checksum, as in memory)."""
    obj, why = read_sealed(path)
    if why is not None and (path, why) not in _reported:
        _reported.add((path, why))
        reft_print(f"{path} {why}: not used", event="untrusted_file", path=path,
                   kind="flushed", why=why)
    return obj


def trusted_flush_dir(flush_dir: str) -> bool:
    """Is ``flush_dir`` this user's private directory? Whoever else can write there
    (another user's directory, one writable by group or others) could forge flushed
    snapshots: nothing is read from it then. Reported once."""
    why = paths.private_problem(flush_dir)
    if why is None or why == "does not exist":
        return why is None
    if (flush_dir, why) not in _reported:
        _reported.add((flush_dir, why))
        reft_print(f"--reft-flush-dir: {flush_dir} {why}: its flushed snapshots are not "
                   f"loaded (whoever else can write there could forge them); point "
                   f"--reft-flush-dir at a directory only this user can write (chmod 700)",
                   event="untrusted_file", path=flush_dir, kind="flushed", why=why)
    return False


def torn_flush(flush_dir: str, rank: int) -> bool:
    """Was this rank's last flush cut short (its watcher killed midway, the marker that
    reft_ext/cluster/watcher.py removes after the last file still there)? Then none of
    its flushed files is imported: they may mix two flushes, or lack the commit pointer
    that says which of them was committed. Reported once."""
    path = os.path.join(flush_dir, f"rank{rank}.flushing")
    if not os.path.exists(path):
        return False
    why = "marks a flush that was cut short"
    if (path, why) not in _reported:
        _reported.add((path, why))
        reft_print(f"{path} {why}: rank {rank}'s flushed snapshots not used",
                   event="untrusted_file", path=path, kind="flushed", why=why, rank=rank)
    return True


def flushed_manifests(flush_dir: str, rank: int) -> dict[int, dict]:
    """slot -> manifest of this rank's flushed slots whose data file is whole."""
    out = {}
    if not trusted_flush_dir(flush_dir):
        return out
    for p in glob.glob(os.path.join(flush_dir, f"rank{rank}.slot*.json")):
        m = re.search(r"\.slot(\d+)\.json$", p)
        try:
            man = _read(p)
            if man is None:
                continue
            if os.path.getsize(p[:-len(".json")] + ".bin") >= man["nbytes"]:
                out[int(m.group(1))] = man
        except (OSError, ValueError, KeyError):
            continue
    return out


def import_flushed(store: SnapshotStore, flush_dir: str, nbytes: int) -> int | None:
    """Put this rank's flushed slots into its store when they are newer than what memory
    holds; returns the newest imported iteration, or None."""
    if not flush_dir or not os.path.isdir(flush_dir) or not trusted_flush_dir(flush_dir):
        return None
    if torn_flush(flush_dir, store.rank):
        return None
    flushed = {s: m for s, m in flushed_manifests(flush_dir, store.rank).items()
               if m.get("nbytes") == nbytes and s in store.slots}
    if not flushed:
        return None
    in_memory = [int(m["iteration"]) for m in store.manifests().values()]
    newest = max(int(m["iteration"]) for m in flushed.values())
    if in_memory and max(in_memory) >= newest:
        return None  # the node's memory survived: it is at least as new
    # every manifest goes first, and memory's commit pointer with them: no old file may
    # describe new bytes (a pointer left behind would commit whatever lands in its slot)
    for name in [store._name(slot, "json") for slot in store.slots] + \
            [f"rank{store.rank}.committed"]:
        try:
            os.unlink(store._path(name))
        except FileNotFoundError:
            pass
    # where each slot's bytes came from, for REFT-load's checksum lines (repairs.py)
    store.imported_from = {}
    for slot, man in flushed.items():
        dst = store.data(slot, nbytes)
        src = os.path.join(flush_dir, f"rank{store.rank}.slot{slot}.bin")
        with open(src, "rb") as f:
            f.readinto(memoryview(dst.numpy()))
        store.finish(slot, man)
        store.imported_from[slot] = f"{src} (flushed; imported into host memory)"
    # the commit pointer the node had (the watcher copies it) is the only proof that a
    # flushed slot was committed: without it none is (finished is not committed)
    pointer, why = _flushed_pointer(flush_dir, store.rank, flushed)
    path = os.path.join(flush_dir, f"rank{store.rank}.committed")
    if pointer is not None:
        store.commit(pointer["slot"], int(pointer["iteration"]))
    elif why is not None and (path, why) not in _reported:
        _reported.add((path, why))
        reft_print(f"{path} {why}: rank {store.rank}'s flushed snapshots imported "
                   f"uncommitted (only an iteration committed on another rank is used)",
                   event="untrusted_file", path=path, kind="flushed", why=why,
                   rank=store.rank)
    return newest


def _flushed_pointer(flush_dir: str, rank: int, flushed: dict) -> tuple[dict | None, str | None]:
    """(the flushed commit pointer, None) when it names a flushed slot of the iteration it
    says, else (None, why); why None: a torn pointer, already reported by :func:`_read`."""
    path = os.path.join(flush_dir, f"rank{rank}.committed")
    try:
        pointer = _read(path)
    except OSError:
        return None, "is missing"
    if pointer is None:
        return None, None
    try:
        slot, it = pointer["slot"], int(pointer["iteration"])
    except (KeyError, TypeError, ValueError):
        return None, "names no slot and iteration"
    if not isinstance(slot, int) or slot not in flushed or \
            int(flushed[slot]["iteration"]) != it:
        return None, f"names slot {slot} of iteration {it}, which is not among the flushed slots"
    return pointer, None

