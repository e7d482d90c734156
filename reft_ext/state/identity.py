"""Run identity: never load another run's state from host memory or the flush directory.

A snapshot used to be accepted when its tensor names, sizes, member and protection
matched. Two runs of the same model shape but another seed, data or protection, started
with the same ``--reft-job-id`` (or a fixed ``--rdzv-id``), would resume each other's
state silently. Every manifest REFT writes now carries the run's identity: the fields
that make a state belong to a run (model shape, tensor/pipeline layout, optimizer
sharding, precision, seed, data, global batch, protection, failure domains). REFT-load
and the flush import compare them with the starting run's, on every rank, and refuse a
mismatch job-wide with one line that names what differs and what to do.

The data-parallel size is not part of it: an elastic shrink reloads the same run's
snapshots at another DP size (reft_ext/load/reshard.py). No manifest older than the
identity exists: one without it (torn, or written by something else) is refused as well.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch


def fingerprint(fields: dict) -> str:
    """A short stable digest of the identity fields (JSON, sorted keys)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp(fields: dict) -> dict:
    """What a manifest carries: the fields and their fingerprint."""
    return {"fingerprint": fingerprint(fields), "fields": fields}


def differences(mine: dict, theirs: dict) -> list[str]:
    keys = sorted(set(mine) | set(theirs))
    return [f"{k} {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in keys
            if mine.get(k) != theirs.get(k)]


def mismatch(manifests: dict, mine: dict) -> str | None:
    """The first way in which ``manifests`` (file -> manifest) belong to another run; a
    manifest without an identity counts as one (a session's snapshots always carry it)."""
    want = fingerprint(mine)
    for path, m in manifests.items():
        ident = m.get("identity")
        if not isinstance(ident, dict):
            return f"{path} carries no run identity: torn, or not written by REFT"
        if ident.get("fingerprint") != want:
            diff = differences(mine, ident.get("fields", {}))
            run = f"run {ident['run']}, " if ident.get("run") else ""
            return (f"{run}iteration {m.get('iteration')}: " +
                    ("; ".join(diff[:4]) if diff else "another fingerprint"))
    return None


def refuse_other_runs(store, flush_dir: str, mine: dict, group,
                      flushed: dict | None = None) -> str | None:
    """Collective over ``group``: the one-line reason (same on every rank) to refuse the
    state this job found, or None. Checks this rank's host-memory snapshots and, when
    ``flush_dir`` is set, its flushed ones: ``flushed``, slot -> manifest, read by the
    caller (reft_ext/load/flushed.py flushed_manifests; the state layer reads no tier)."""
    why = mismatch({store._path(store._name(s, "json")): m
                    for s, m in store.manifests().items()}, mine)
    if why:
        why = (f"--reft-job-id: host memory ({store.dir}) holds snapshots of another run "
               f"({why}). Start this run with another --reft-job-id (or torchrun "
               f"--rdzv-id), or remove {store.dir} if that run is over")
    elif flush_dir:
        why = mismatch({os.path.join(flush_dir, f"rank{store.rank}.slot{s}.json"): m
                        for s, m in (flushed or {}).items()}, mine)
        if why:
            why = (f"--reft-flush-dir: {flush_dir} holds flushed snapshots of another run "
                   f"({why}). Give this run its own --reft-flush-dir (or --save), or "
                   f"remove that directory if that run is over")
    seen = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(seen, why, group=group)
    return next((w for w in seen if w), None)
