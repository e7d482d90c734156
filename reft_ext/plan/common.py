"""What the planner's config dataclasses share: documented fields that become flags, and
one error type whose message names the flag."""

from __future__ import annotations

import argparse
from dataclasses import fields

from reft_ext.flags import add_flags, field_type, flag_field, flag_name, flag_values

__all__ = ["PlanConfigError", "flag_field", "flag_of", "fail", "positive", "add_arguments",
           "from_args"]


class PlanConfigError(ValueError):
    """A planner input that cannot describe a run; the message names the flag."""


def flag_of(cls, name: str) -> str:
    for f in fields(cls):
        if f.name == name:
            return flag_name(f) or "--" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


def fail(flag: str, msg: str):
    raise PlanConfigError(f"{flag}: {msg}")


def positive(cls, obj, *names):
    """Every named field is >= 1 (int fields) or > 0 (float fields); None passes."""
    kinds = {f.name: field_type(f) for f in fields(cls)}
    for name in names:
        v = getattr(obj, name)
        if v is None:
            continue
        if kinds[name] is int and v < 1:
            fail(flag_of(cls, name), f"must be >= 1, got {v}")
        if kinds[name] is not int and v <= 0:
            fail(flag_of(cls, name), f"must be > 0, got {v}")


def add_arguments(parser: argparse.ArgumentParser, cls, title: str) -> None:
    """One flag per field of dataclass ``cls``; defaults stay None so that ``from_args``
    leaves unset flags to the dataclass (and its profile or preset)."""
    add_flags(parser, cls, title, defaults=False)


def from_args(cls, args, **extra):
    """Build ``cls`` from parsed flags: only the flags given on the command line."""
    return cls(**dict(flag_values(cls, args, given_only=True), **extra))
