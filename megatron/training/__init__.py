"""Our training loop and thin hooks into megatron-core (no megatron/__init__.py: the
``megatron`` namespace is shared with megatron-core's ``megatron.core``)."""

from megatron.training import fallbacks, lazy_jit

# before anything here imports megatron.core: its fusion kernels are compiled on first
# use, not at import, where torch's compiler would weigh on every rank's start-up (see
# lazy_jit.py; the figures: docs/foundation.md)
lazy_jit.install()
# and its "X is not installed. Falling back to ..." warnings (one per module, per rank)
# become one line at start-up (fallbacks.py)
fallbacks.install()
