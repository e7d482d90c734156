"""The places a start reads and writes, checked on this machine before any work (the data
set, its cache, --save and --load, the save-on-failure directory). Apart from
megatron/training/argument_validation.py's validate_args, which judges flags and layouts alone (a
script's dry run on a laptop, an elastic shrink's new layout)."""

from __future__ import annotations

import os
import warnings


def check_paths(args, _fail) -> None:
    """The places a start reads and writes, checked on this machine before any work:
    the data set exists, --save and the save-on-failure directory can be written.
    ``_fail(flag, why)``: the trainer's flag error (argument_validation.py's, which raises)."""
    from reft_ext.config import ReftConfig

    if args.data_path is not None and not args.mock_data:
        from megatron.training.dataset_files import data_path_error

        why = data_path_error(args.data_path, args.tokenizer_type)
        if why:
            _fail("--data-path", why)
    with warnings.catch_warnings():  # megatron-core's import notes: not this start's error
        warnings.simplefilter("ignore")
        from megatron.training.data_cache_dir import data_cache_path_error

    why = data_cache_path_error(args.data_cache_path)  # megatron-core unpickles from it
    if why:
        _fail("--data-cache-path", why)
    if getattr(args, "tensorboard_dir", None):  # event files written there by name
        why = private_dir_error(args.tensorboard_dir)
        if why:
            _fail("--tensorboard-dir", why)
    for flag in ("--save", "--load"):  # a checkpoint is unpickled when it is loaded
        path = getattr(args, flag[2:], None)
        why = path and not getattr(args, "trust_shared_checkpoint_dir", False) and \
            checkpoint_dir_error(flag, path)
        if why:
            _fail(flag, why)
    if args.save:
        _check_writable_dir("--save", args.save, "point it at a directory this user can "
                            "create and write (checkpoints are written there)", _fail)
        from megatron.training.save_space import start_error

        why = start_error(args)  # not one checkpoint's space: said before any work
        if why:
            _fail("--save", why)
    cfg = ReftConfig.from_args(args)
    if cfg.enabled and cfg.flush_dir:  # save-on-failure writes there when it is needed
        _check_writable_dir("--reft-flush-dir", cfg.flush_dir, "point it at a directory "
                            "this user can create and write (default <--save>/reft-flush), "
                            "or give --reft-flush-dir none to turn save-on-failure off", _fail)


def checkpoint_dir_error(flag: str, path: str) -> str | None:
    """Why --save/--load ``path`` is one another user could write or swap (theirs, writable
    by group or others, a link, or below such a directory: reft_ext/safe_dir.py), or
    None. A checkpoint's metadata is a pickle: whoever can plant one (and re-seal its
    integrity.json, whose writer is public) runs code as this user at the load. A --save
    not made yet: the nearest existing directory above it, where it will be made."""
    from reft_ext import safe_dir

    target = base = os.path.abspath(path)
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    why = safe_dir.problem(base, kind=safe_dir.TRUSTED if base == target else safe_dir.PARENT)
    if why is None or why in ("does not exist", "is not a directory"):
        return None  # (the other checks' business: a --load that is not there)
    where = path if base == target else f"{path} (to be made in {base})"
    return (f"{where} {why}: another user who can write or swap it could plant a checkpoint "
            f"that runs code as you when it is loaded; use a directory only you can write "
            f"(chmod 700), or add --trust-shared-checkpoint-dir if it is shared on purpose "
            f"with users you trust")


def private_dir_error(path: str) -> str | None:
    """Why ``path`` cannot be a private directory of this user's (as the launchers'
    --log-dir): one that is a link, another user's, writable by group or others, or below
    a directory another user could swap; for one not made yet, the directory it will be
    made in. None when it can (:func:`open_private_dir` makes and holds it)."""
    from reft_ext import safe_dir

    target = base = os.path.abspath(path)
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    why = safe_dir.problem(base, kind=safe_dir.PRIVATE if base == target else safe_dir.PARENT)
    if why is None or why == "does not exist":
        return None
    where = path if base == target else f"{path} (to be made in {base})"
    return (f"{where} {why}: files are written there by name, so another user who can "
            f"write or swap it could read or replace them; give a directory only you can "
            f"write (chmod 700), or a new one (made 0700)")


def open_private_dir(path: str):
    """``path`` made (0700) or opened as a private directory of this user's, held open
    (reft_ext/safe_dir.py: write through its ``proc_path``)."""
    from reft_ext import safe_dir

    return safe_dir.open_dir(path, create=True)


def foreign_checkpoint_error(flag: str, *paths: str, trust: bool = False) -> str | None:
    """The tools' check before they load a checkpoint (tools/convert_checkpoint.py,
    tools/compare_checkpoints.py): :func:`checkpoint_dir_error` of each of ``paths`` (a
    root and the ``iter_*`` directory in it that is read), as the trainer's --load; None
    when all are this user's own or ``trust`` (--trust-shared-checkpoint-dir)."""
    if trust:
        return None
    for path in paths:
        why = checkpoint_dir_error(flag, path)
        if why:
            return f"{flag} {why}"
    return None


def _check_writable_dir(flag: str, path: str, what: str, _fail) -> None:
    """``path`` is a directory this process can create (or has) and write into. Probed
    with a temporary entry, removed at once: a refused start leaves nothing behind, and
    a directory that cannot be written fails now, not when a save is due."""
    import tempfile

    target = os.path.abspath(path)
    base = target  # the nearest existing ancestor: where the directory would be made
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        _fail(flag, f"{path} exists and is not a directory; {what}" if base == target
              else f"cannot create {path}: {base} is not a directory; {what}")
    try:
        if base == target:
            fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=target)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".create-check-", dir=base))
    except OSError as exc:
        verb = "write into" if base == target else "create"
        _fail(flag, f"cannot {verb} {path} ({exc.strerror} in {base}); {what}")
