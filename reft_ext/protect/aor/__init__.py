"""AOR: a host-side replica of a peer's ZeRO-1 optimizer shard, kept current by recomputation."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "AORReplica": "replica",
    "OwnerShard": "replica",
    "AORTransport": "transport",
    "connect": "transport",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
