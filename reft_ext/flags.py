"""Command-line flags generated from config dataclasses: one field, one flag, its help
text in the field's metadata. REFT's configs (ReftConfig, HealthConfig, RollbackConfig)
and the planner's (reft_ext/plan/) share this generator; they differ only in style:

* REFT's (``--reft-<field>``, read back as ``args.reft_<field>``): a flag's default is
  the field's, and ``from_args`` reads every field.
* the planner's (``--<field>`` or the field's own ``flag``, read back as ``args.<field>``):
  unset flags stay None, so ``from_args`` leaves them to the dataclass (or its profile or
  preset), and the help text names the default.

Plain Python (no torch): flags are parsed before anything heavy is imported.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields


def flag_field(default, help: str, flag: str | None = None):
    """A dataclass field documented by its flag's help text (``flag`` overrides the
    generated name; ``""`` means no flag)."""
    return field(default=default, metadata={"help": help, "flag": flag})


def field_type(f) -> type:
    """bool, int, float or str, from the field's annotation (a string under
    ``from __future__ import annotations``; ``int | None`` counts as int)."""
    t = str(f.type)
    if "bool" in t:
        return bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def flag_name(f, prefix: str = "--") -> str | None:
    """The field's flag: its metadata's ``flag``, else ``prefix`` + the dashed name; None
    for a field without a flag."""
    flag = f.metadata.get("flag")
    if flag == "":
        return None
    return flag or prefix + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls, title: str, *, prefix: str = "--",
              dest_prefix: str = "", defaults: bool = True) -> None:
    """One flag per field of dataclass ``cls`` in an argument group ``title``.

    defaults: True, a flag's default is its field's (REFT's style); False, every flag
    defaults to None and its help ends with "(default X)" (the planner's style)."""
    g = parser.add_argument_group(title)
    for f in fields(cls):
        flag = flag_name(f, prefix)
        if flag is None:
            continue
        typ, dest = field_type(f), dest_prefix + f.name
        default = f.default if f.default is not MISSING else None
        if defaults:
            help_ = f.metadata.get("help")
            if typ is bool:
                g.add_argument(flag, dest=dest, action="store_true", help=help_)
            else:
                g.add_argument(flag, dest=dest, type=typ, default=default, help=help_)
            continue
        help_ = f.metadata.get("help", "")
        if default not in (None, False, 0, 0.0, ""):
            help_ += f" (default {default:g})" if isinstance(default, float) else \
                f" (default {default})"
        if typ is bool:
            g.add_argument(flag, dest=dest, action="store_true", default=None, help=help_)
        else:
            metavar = {int: "N", float: "X"}.get(typ, "NAME")
            g.add_argument(flag, dest=dest, type=typ, default=None, metavar=metavar,
                           help=help_)


def flag_values(cls, args, dest_prefix: str = "", *, given_only: bool = False) -> dict:
    """field -> its flag's parsed value; ``given_only``: only the flags that are set (not
    None), so that the others keep the dataclass's defaults."""
    flagged = [f for f in fields(cls) if flag_name(f) is not None]  # the others: defaults
    if not given_only:
        return {f.name: getattr(args, dest_prefix + f.name) for f in flagged}
    return {f.name: getattr(args, dest_prefix + f.name) for f in flagged
            if getattr(args, dest_prefix + f.name, None) is not None}


class ReftFlags:
    """``add_arguments`` / ``from_args`` of a REFT config dataclass: ``--reft-<field>``
    flags in an argument group named by ``FLAG_TITLE``."""

    FLAG_TITLE = "REFT"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls, cls.FLAG_TITLE, prefix="--reft-", dest_prefix="reft_")

    @classmethod
    def from_args(cls, args):
        return cls(**flag_values(cls, args, "reft_"))
