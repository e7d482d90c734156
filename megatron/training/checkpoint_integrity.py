"""Checksums of persistent checkpoints: every file a save wrote, verified before a load.

The persistent checkpoint is REFT's last line of defence, and torch DCP reads its
``.distcp`` shards without any checksum: a flipped byte loads silently and training goes
on from the corrupted state. So each save ends with ``integrity.json`` in the
checkpoint's directory: the size and SHA-256 of every file in it, sealed with its own
digest (reft_ext/store/slots.py ``sealed``) and written after every other file and
before Megatron's tracker, so it also marks a save that finished. A load verifies the
files first and refuses a mismatch naming the file (megatron/training/checkpointing.py
then falls back to the newest older iteration that verifies).

Each rank hashes the shards it wrote itself (``__<rank>_<n>.distcp``: still in its page
cache, and on a cluster filesystem no rank reads another's files); rank 0 hashes the
rest. Verification splits the files the same way (rank modulo the world size).

The plain functions (``index_of``, ``verify_files``) need no process group:
``tools/compare_checkpoints.py --verify`` uses them on a stopped job's checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re

from reft_ext.store.atomic import write_atomic
from reft_ext.store.slots import read_sealed, sealed

INDEX = "integrity.json"
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")
_CHUNK = 8 << 20


class IntegrityError(RuntimeError):
    """A checkpoint whose files do not match its index, or that has none."""


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def owner_of(name: str, world: int) -> int:
    """The rank that hashes (and verifies) a file: a shard's writer, else rank 0."""
    m = _SHARD.match(name)
    return int(m.group(1)) % world if m else 0


def checkpoint_files(path: str) -> list[str]:
    """The files of one checkpoint directory that the index covers (all but itself and
    temporaries of an atomic write)."""
    return sorted(n for n in os.listdir(path)
                  if n != INDEX and not n.endswith(".tmp")
                  and os.path.isfile(os.path.join(path, n)))


def hash_files(path: str, names) -> dict[str, dict]:
    return {n: {"bytes": os.path.getsize(os.path.join(path, n)),
                "sha256": file_sha256(os.path.join(path, n))} for n in names}


def write_index(path: str, iteration: int, files: dict[str, dict]) -> None:
    write_atomic(os.path.join(path, INDEX),
                 sealed({"iteration": iteration, "algorithm": "sha256", "files": files}),
                 durable=True)


def index_of(path: str) -> dict:
    """The sealed index of a checkpoint directory, or IntegrityError saying why not."""
    index = os.path.join(path, INDEX)
    try:
        obj, why = read_sealed(index)
    except FileNotFoundError:
        raise IntegrityError(f"{index} is missing: the save did not finish, or the "
                             f"checkpoint was not written by this trainer") from None
    except OSError as exc:
        raise IntegrityError(f"{index} cannot be read: {exc}") from None
    if obj is None:
        raise IntegrityError(f"{index} {why}")
    if not isinstance(obj.get("files"), dict) or not obj["files"]:
        raise IntegrityError(f"{index} lists no files")
    return obj


def verify_files(path: str, index: dict, names=None, progress=None) -> list[str]:
    """What is wrong with the files ``names`` (default: all the index lists, and any file
    it does not list), one line each naming the file; empty when they verify."""
    files = index["files"]
    problems = []
    if names is None:
        names = sorted(files)
        extra = sorted(set(checkpoint_files(path)) - set(files))
        problems += [f"{os.path.join(path, n)}: not in {INDEX}" for n in extra]
    for name in names:
        want, p = files[name], os.path.join(path, name)
        try:
            size = os.path.getsize(p)
            if size != want["bytes"]:
                problems.append(f"{p}: {size} bytes, {INDEX} says {want['bytes']}")
            elif file_sha256(p) != want["sha256"]:
                problems.append(f"{p}: SHA-256 differs from {INDEX} (corrupted)")
        except OSError as exc:
            problems.append(f"{p}: {exc.strerror or exc}")
        if progress is not None:
            progress(want["bytes"])
    return problems


# ---- collective parts (every rank of the job calls them, in the same order) ----------
def seal_checkpoint(path: str, iteration: int) -> None:
    """After every rank finished writing ``path``: each hashes its share, rank 0 writes
    the index. Call before the tracker names the checkpoint."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [n for n in checkpoint_files(path) if owner_of(n, world) == rank]
    shares = [None] * world
    dist.all_gather_object(shares, hash_files(path, mine))
    if rank == 0:
        files = {k: v for share in shares for k, v in share.items()}
        missing = sorted(set(checkpoint_files(path)) - set(files))
        files.update(hash_files(path, missing))  # written after the listing: rank 0's
        write_index(path, iteration, files)


def verify_checkpoint(path: str) -> list[str]:
    """Every rank verifies its share of ``path``'s files; all ranks get every problem
    (the same list, so they take the same decision)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        index = index_of(path)
        mine = [n for n in sorted(index["files"]) if owner_of(n, world) == rank]
        problems = verify_files(path, index, mine)
        if rank == 0:
            extra = sorted(set(checkpoint_files(path)) - set(index["files"]))
            problems += [f"{os.path.join(path, n)}: not in {INDEX}" for n in extra]
    except IntegrityError as exc:
        problems = [str(exc)]
    gathered = [None] * world
    dist.all_gather_object(gathered, problems)
    return sorted({p for share in gathered for p in share})
