"""What the training loop calls on the objects in ``Trainer.hooks``, and when.

A hook subclasses :class:`TrainerHook` and overrides only what it needs: the loop calls
all four methods on every hook, so each has a no-op default here (not a ``getattr``
fallback at the call site). REFT's session (reft_ext/session.py, built by
reft_integration.py) is the first hook of a run and has the same four methods (reft_ext
never imports the trainer, so it matches the interface without subclassing it); tests
and benchmarks append their own probes after it.
"""

from __future__ import annotations


class TrainerHook:
    """The hook interface, with no-op defaults."""

    def on_start(self, state) -> None:
        """Before the first iteration of this process (the state is loaded)."""

    def before_optimizer_step(self, state) -> None:
        """After the forward and backward passes of iteration ``state.iteration + 1``,
        before its optimizer step changes the state."""

    def after_step(self, state) -> None:
        """After the step: ``state.iteration`` is the iteration just completed. A hook
        may take the state back to an older iteration (a loss-spike rollback)."""

    def on_exit(self, state) -> None:
        """After the final save, before the trace and the end-of-run lines."""
