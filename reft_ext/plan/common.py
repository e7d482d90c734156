"""What the planner's config dataclasses share: documented fields that become flags, and
one error type whose message names the flag."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields


class PlanConfigError(ValueError):
    """A planner input that cannot describe a run; the message names the flag."""


def flag_field(default, help: str, flag: str | None = None):
    """A dataclass field documented by its flag's help text (``flag`` overrides the
    generated ``--field-name``; ``""`` means no generated flag)."""
    return field(default=default, metadata={"help": help, "flag": flag})


def flag_of(cls, name: str) -> str:
    for f in fields(cls):
        if f.name == name and f.metadata.get("flag"):
            return f.metadata["flag"]
    return "--" + name.replace("_", "-")


def fail(flag: str, msg: str):
    raise PlanConfigError(f"{flag}: {msg}")


def positive(cls, obj, *names):
    """Every named field is >= 1 (int fields) or > 0 (float fields); None passes."""
    kinds = {f.name: _type(f) for f in fields(cls)}
    for name in names:
        v = getattr(obj, name)
        if v is None:
            continue
        if kinds[name] is int and v < 1:
            fail(flag_of(cls, name), f"must be >= 1, got {v}")
        if kinds[name] is not int and v <= 0:
            fail(flag_of(cls, name), f"must be > 0, got {v}")


def _type(f):
    t = str(f.type)
    if "bool" in t:
        return bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def add_arguments(parser: argparse.ArgumentParser, cls, title: str) -> None:
    """One flag per field of dataclass ``cls``; defaults stay None so that ``from_args``
    leaves unset flags to the dataclass (and its profile or preset)."""
    g = parser.add_argument_group(title)
    for f in fields(cls):
        flag = f.metadata.get("flag", None)
        if flag == "":
            continue
        flag = flag or "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        text = f.metadata.get("help", "")
        if default not in (None, False, 0, 0.0, ""):
            text += f" (default {default:g})" if isinstance(default, float) else \
                f" (default {default})"
        typ = _type(f)
        if typ is bool:
            g.add_argument(flag, dest=f.name, action="store_true", default=None, help=text)
        else:
            metavar = {int: "N", float: "X"}.get(typ, "NAME")
            g.add_argument(flag, dest=f.name, type=typ, default=None, metavar=metavar,
                           help=text)


def from_args(cls, args, **extra):
    """Build ``cls`` from parsed flags: only the flags given on the command line."""
    kw = {f.name: getattr(args, f.name) for f in fields(cls)
          if getattr(args, f.name, None) is not None}
    kw.update(extra)
    return cls(**kw)
