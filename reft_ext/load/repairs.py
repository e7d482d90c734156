"""What REFT-load says of each region that failed its checksum: one ``[REFT]`` line per
failure of the restored iteration, naming the file the bytes came from (host memory's
slot, or the flushed file it was imported from: reft_ext/load/flushed.py) and what
served that part of the state instead (an ARC replica, AEC parity, an AOR replica).

Pure functions of the agreed plan and this rank's failures; reft_ext/load/recover.py
collects the failures while it verifies (both rounds, the fused pass too) and prints.
"""

from __future__ import annotations

from reft_ext.state.regions import Region, Source

# what a region holds, as the line names it
HOLDS = {Region.OWN: "its slice of the parameters and replicated optimizer state",
         Region.REDUNDANCY: "the redundancy block it keeps for a peer",
         Region.OWNED: "its ZeRO-1 optimizer shard",
         Region.AOR: "the AOR replica it keeps of a peer's optimizer shard"}


def served_by(region: Region, rank: int, group) -> str:
    """What took the failed region's place in ``group`` (the rank's GroupPlan)."""
    member = group.ranks.index(rank)
    if region is Region.OWN:
        how = group.slices[member]
        if how == Source.REPLICA:
            provider = next((p for j, p, to in group.sends if j == member and to == member),
                            None)
            where = f" on rank {group.ranks[provider]}" if provider is not None else ""
            return f"rebuilt from the ARC replica{where}"
        if how == Source.PARITY:
            return "decoded from the group's AEC parity"
        return "restored from its own memory"
    if region is Region.OWNED:
        holder = (group.owned_from or {}).get(rank, rank)
        return f"restored from the AOR replica on rank {holder}" if holder != rank \
            else "restored from its own memory"
    return "not needed (its owner restored that part from its own memory)"


def repair_lines(rank: int, iteration: int, group, failed: set, manifests: dict,
                 files: dict) -> list[str]:
    """One line per (slot, region) in ``failed`` whose slot holds ``iteration``;
    ``files``: slot -> the file its bytes came from."""
    out = []
    for slot, region in sorted(failed, key=lambda f: (f[0], str(f[1]))):
        m = manifests.get(slot)
        if m is None or int(m["iteration"]) != iteration:
            continue
        region = Region(region)
        algo = m.get("checksum", "crc32")
        out.append(f"rank {rank}: {files[slot]} failed its {algo} checksum in "
                   f"{HOLDS[region]} ({region} region, iteration {iteration}): "
                   f"{served_by(region, rank, group)}")
    return out
