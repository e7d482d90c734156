"""The trainer's flag error, in a module of its own: arguments.py validates the
``--inject-*`` flags with fault_injection.py's parsers, and both raise this (neither
module imports the other's importer)."""


class ArgumentError(ValueError):
    """An invalid flag value or combination; the message names the flag."""
