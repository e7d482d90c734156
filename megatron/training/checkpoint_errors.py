"""The error of a missing, corrupt or incompatible saved state (the trainer stops with its
one line, exit status 3). Its own module: checkpointing.py raises it, and so does the
schedule check both tiers make (scheduler_resume.py), which checkpointing.py imports."""


class CheckpointError(RuntimeError):
    """A missing, corrupt or incompatible checkpoint; the message names the path."""
