"""AOR: a host-side replica of a peer's ZeRO-1 optimizer shard, kept current by recomputation."""
