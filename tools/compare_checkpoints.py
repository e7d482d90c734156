"""Compare two persistent checkpoints item by item, independently of REFT.

    python tools/compare_checkpoints.py A B [--ignore PATTERN ...]
    python tools/compare_checkpoints.py --verify DIR

A and B are checkpoint roots (``--save`` directories: the iteration their
``latest_checkpointed_iteration.txt`` names) or ``iter_XXXXXXX`` directories. Each is
read through megatron-core's own ``dist_checkpointing`` from the metadata the checkpoint
carries (every ShardedTensor and ShardedObject it holds, plus the common state dict), not
through the list of tensors REFT snapshots (``TrainingState.state_tensors``) that the
``[HASH]`` lines hash: whatever that list misses, this comparison still sees.

Compared bit for bit: every parameter, every optimizer state tensor (ZeRO-1 shards
included) and its step, the LR scheduler, every rank's RNG states, the iteration and the
data position (consumed samples), and every other item. Not compared by default: the
run's own history in ``train_state.extra`` (run id, start time, REFT's counters of
snapshots and recoveries), which differs between a run that failed and one that did not.

Prints ``identical`` or a table of what differs (name, shape, max abs diff, first
differing index); exits 1 on any difference, 2 when a checkpoint cannot be read or is
refused: one another user can write (its metadata is a pickle) is refused before anything
is loaded, as the trainer's --load refuses it, unless ``--trust-shared-checkpoint-dir``.
``--verify DIR`` checks a checkpoint's files against its checksums
(``integrity.json``, megatron/training/checkpoint_integrity.py) without loading it; DIR
may be a root, whose every ``iter_*`` is verified.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# the run's history, not its state (train_state.extra: megatron/training/training.py
# _agree_start, reft_ext/report/summary.py KEY)
DEFAULT_IGNORE = ("train_state.extra.run_id", "train_state.extra.run_started",
                  "train_state.extra.reft", "train_state.extra.reft.*")
TRACKER = "latest_checkpointed_iteration.txt"


def resolve(path: str) -> str:
    """An ``iter_*`` directory: ``path`` itself, or the one its tracker names."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if not text.isdigit():
            raise SystemExit(f"error: {tracker} holds {text!r}, not an iteration")
        return os.path.join(path, f"iter_{int(text):07d}")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise SystemExit(f"error: {path} is neither a checkpoint root (no {TRACKER}) nor "
                         f"a checkpoint directory (no metadata.json)")
    return path


# ---- reading: one flat {name: leaf} per checkpoint --------------------------------------
def flatten(obj, prefix: str, out: dict) -> dict:
    """Nested dicts, lists and tuples to ``a.b.0.c`` names; JSON text of train_state.extra
    parsed so that its items compare one by one."""
    if prefix == "train_state.extra" and isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError:
            pass
    if isinstance(obj, dict):
        if not obj:
            out[prefix] = {}
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        if not obj:
            out[prefix] = type(obj)()
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = obj
    return out


def _with_process_group(fn):
    """dist_checkpointing needs a process group: one of this process alone (a file
    store, no port), unless the caller already has one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return fn()
    with tempfile.TemporaryDirectory(prefix="compare-ckpt-") as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0,
                                world_size=1)
        try:
            return fn()
        finally:
            dist.destroy_process_group()


def read(path: str) -> dict:
    """Every item of the checkpoint in ``path`` (an iter_ directory), flat."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    def load():
        common = dist_checkpointing.load_common_state_dict(path)
        meta = serialization.load_sharded_metadata(path)
        # each rank's whole tensors, not a rank's shard: access overlaps on purpose
        sharded = dist_checkpointing.load(meta, path, validate_access_integrity=False)
        return common, sharded

    common, sharded = _with_process_group(load)
    out = flatten(common, "", {})
    for key, value in sharded.items():
        flatten(value, key, out)
    return out


# ---- comparing --------------------------------------------------------------------------
def _tensor_diff(a, b) -> dict | None:
    """None when bit-identical, else the row's details (NaNs compare by their bits)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return {"shape": f"{tuple(a.shape)}/{tuple(b.shape)}",
                "detail": f"dtype {a.dtype}/{b.dtype}" if a.dtype != b.dtype else "shape"}
    flat_a, flat_b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    size = a.element_size()
    # element by element over their bytes: NaNs and -0.0 compare by their bits
    differ = torch.nonzero((flat_a.view(torch.uint8).view(-1, size) !=
                            flat_b.view(torch.uint8).view(-1, size)).any(dim=1)).view(-1)
    if not differ.numel():
        return None
    first = int(differ[0])
    index = tuple(int(i) for i in _unravel(first, tuple(a.shape))) if a.dim() else ()
    row = {"shape": tuple(a.shape), "first": index, "count": int(differ.numel())}
    if a.is_floating_point() or a.is_complex():
        row["max_abs"] = float((flat_a.double() - flat_b.double()).abs().nan_to_num(
            nan=float("inf")).max())
    elif a.dtype != torch.bool:
        row["max_abs"] = float((flat_a.long() - flat_b.long()).abs().max())
    return row


def _unravel(i: int, shape: tuple) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return list(reversed(out))


def _leaf_diff(a, b) -> dict | None:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensor_diff(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return _tensor_diff(torch.from_numpy(np.ascontiguousarray(a)),
                            torch.from_numpy(np.ascontiguousarray(b)))
    if type(a) is not type(b):
        return {"shape": "", "detail": f"{type(a).__name__} vs {type(b).__name__}"}
    if isinstance(a, float) and a != a and b != b:  # NaN == NaN here
        return None
    return None if a == b else {"shape": "", "detail": f"{a!r} vs {b!r}"[:120]}


def compare(a: dict, b: dict, ignore=DEFAULT_IGNORE) -> tuple[list[tuple[str, dict]], dict]:
    """(rows of what differs, counts): every name in either checkpoint not ignored."""
    import torch

    names = sorted(set(a) | set(b))
    skipped = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    rows, tensors, items = [], 0, 0
    for name in names:
        if name in skipped:
            continue
        if name not in a or name not in b:
            rows.append((name, {"shape": "", "detail": f"only in {'A' if name in a else 'B'}"}))
            continue
        if isinstance(a[name], torch.Tensor):
            tensors += 1
        else:
            items += 1
        diff = _leaf_diff(a[name], b[name])
        if diff is not None:
            rows.append((name, diff))
    return rows, {"tensors": tensors, "items": items, "ignored": skipped}


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [f"{'name':<70} {'shape':<18} {'max abs diff':>13} {'first differing index'}"]
    for name, d in rows:
        max_abs = f"{d['max_abs']:.6g}" if "max_abs" in d else ""
        where = f"{d['first']} ({d['count']} differ)" if "first" in d else d.get("detail", "")
        lines.append(f"{name:<70} {str(d['shape']):<18} {max_abs:>13} {where}")
    return "\n".join(lines)


class CheckpointRefused(Exception):
    """A checkpoint another user could have written (its metadata is a pickle)."""


def compare_paths(path_a: str, path_b: str, ignore=DEFAULT_IGNORE,
                  trust_shared_dir: bool = False) -> tuple[list, dict]:
    """Both checkpoints checked as the trainer's --load checks them (not another user's,
    not writable by others, no link: megatron/training/path_checks.py) before either is
    read, unless ``trust_shared_dir`` (--trust-shared-checkpoint-dir)."""
    from megatron.training.path_checks import foreign_checkpoint_error

    for path in (path_a, path_b):
        why = foreign_checkpoint_error("checkpoint", path, trust=trust_shared_dir)
        if why:
            raise CheckpointRefused(why)
    a, b = resolve(path_a), resolve(path_b)
    for path in (a, b):
        why = foreign_checkpoint_error("checkpoint", path, trust=trust_shared_dir)
        if why:
            raise CheckpointRefused(why)
    return compare(read(a), read(b), ignore)


# ---- --verify ---------------------------------------------------------------------------
def verify(path: str) -> int:
    from megatron.training.checkpoint_integrity import IntegrityError, index_of, verify_files

    dirs = [path] if os.path.isfile(os.path.join(path, "metadata.json")) else sorted(
        os.path.join(path, n) for n in os.listdir(path) if re.fullmatch(r"iter_\d+", n))
    if not dirs:
        print(f"error: {path} holds no checkpoint (no metadata.json, no iter_* directory)",
              file=sys.stderr)
        return 2
    bad = 0
    for d in dirs:
        try:
            index = index_of(d)
            problems = verify_files(d, index)
        except IntegrityError as exc:
            problems = [str(exc)]
        if problems:
            bad += 1
            print(f"{d}: REFUSED")
            for p in problems:
                print(f"  {p}")
        else:
            size = sum(f["bytes"] for f in index["files"].values())
            print(f"{d}: verified ({len(index['files'])} files, {size / 2**20:.1f} MiB)")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*", metavar="A B", help="two checkpoints to compare")
    p.add_argument("--verify", metavar="DIR", help="check DIR's files against their checksums")
    p.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="names not to compare (fnmatch), in addition to the run's history")
    p.add_argument("--trust-shared-checkpoint-dir", action="store_true",
                   help="read checkpoints another user can write (the trainer's flag: a "
                        "checkpoint's metadata is a pickle, loading it runs what it holds); "
                        "without it such a directory is refused")
    p.add_argument("--compare-history", action="store_true",
                   help="compare train_state.extra's run id and REFT counters too")
    args = p.parse_args(argv)
    if args.verify:
        return verify(args.verify)
    if len(args.checkpoints) != 2:
        p.error("give two checkpoints A B, or --verify DIR")
    ignore = tuple(args.ignore) + (() if args.compare_history else DEFAULT_IGNORE)
    try:
        rows, counts = compare_paths(*args.checkpoints, ignore=ignore,
                                     trust_shared_dir=args.trust_shared_checkpoint_dir)
    except SystemExit:
        raise
    except CheckpointRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a checkpoint that cannot be read: say which
        print(f"error: cannot read the checkpoints: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    what = f"{counts['tensors']} tensors and {counts['items']} other items"
    if not rows:
        print(f"identical ({what} compared; not compared: "
              f"{', '.join(counts['ignored']) or 'nothing'})")
        return 0
    print(f"{len(rows)} of {counts['tensors'] + counts['items']} items differ:")
    print(table(rows))
    return 1


if __name__ == "__main__":
    sys.exit(main())
