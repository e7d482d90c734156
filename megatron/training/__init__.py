"""Our training loop and thin hooks into megatron-core (no megatron/__init__.py: the
``megatron`` namespace is shared with megatron-core's ``megatron.core``)."""
