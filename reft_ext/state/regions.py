"""The names of a snapshot slot's regions and of the sources a slice is rebuilt from.

Both are ``str`` enums: the values are what manifests store (JSON) and what older slots
already hold, so ``Region.OWN == "own"`` and a manifest written before this module existed
still reads. Everything in reft_ext says ``Region.OWN`` instead of the bare string.
"""

from __future__ import annotations

from enum import Enum


class Region(str, Enum):
    """One region of a rank's snapshot slot (its byte range is in the manifest)."""

    OWN = "own"                # this rank's 1/D slice of the DP-replicated state
    REDUNDANCY = "redundancy"  # an ARC replica of a peer's slice or an AEC parity block
    OWNED = "owned"            # state only this rank has (its ZeRO-1 optimizer shard)
    AOR = "aor"                # the host-side replica of a peer's optimizer shard (AOR)

    def __str__(self) -> str:  # f-strings and log lines print the plain name
        return self.value


class Source(str, Enum):
    """Where the recovery plan takes one member's slice from."""

    OWN = "own"          # the member's own memory
    REPLICA = "replica"  # the ARC replica held by the next member of the group
    PARITY = "parity"    # rebuilt by XOR from the group's parity and surviving slices

    def __str__(self) -> str:
        return self.value

    @property
    def label(self) -> str:
        """How log lines name this source."""
        return {"own": "own memory", "replica": "ARC replica", "parity": "AEC parity"}[self.value]
