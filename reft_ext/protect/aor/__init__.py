"""AOR: a host-side replica of a peer's ZeRO-1 optimizer shard, kept current by recomputation."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "replica": ("AORReplica",),
    "owner": ("OwnerShard",),
    "transport": ("AORTransport", "connect"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
