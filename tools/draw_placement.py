"""Draw a sharding group's placement (reft_ext/protect/placement.py) as a PNG: nodes as
boxes holding their ranks, an arrow from each ARC/AOR keeper to the rank whose copy it
keeps, and the AEC parity groups as colours. The picture is computed by the same
function REFT-save places with, so it cannot drift from the code.

    python tools/draw_placement.py --ranks 0-7 --ranks-per-node 2 -o docs/img/placement.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reft_ext.protect.placement import place  # noqa: E402

COLOURS = ["#cfe2f3", "#fce5cd", "#d9ead3", "#ead1dc", "#fff2cc", "#d0e0e3", "#f4cccc",
           "#d9d2e9"]


def _ranks(text: str) -> list[int]:
    """"0-7" or "0,2,4,6" (or a mix)."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def draw(ranks: list[int], ranks_per_node: int, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    p = place(ranks, ranks_per_node)
    nodes = sorted(set(p.domains))
    per_node = {n: [d for d in range(p.D) if p.domains[d] == n] for n in nodes}
    depth = max(len(m) for m in per_node.values())
    colour = {m: COLOURS[i % len(COLOURS)] for i, g in enumerate(p.parity_groups) for m in g}
    fig, ax = plt.subplots(figsize=(2.2 * len(nodes) + 1.5, 1.3 * depth + 2.2))
    centre = {}
    for i, n in enumerate(nodes):  # a node: a grey box; its ranks stacked inside
        x = 2.2 * i
        ax.add_patch(FancyBboxPatch((x - 0.75, -depth * 1.3 + 0.35), 1.5, depth * 1.3 + 0.1,
                                    boxstyle="round,pad=0.05", fc="#f4f4f4", ec="#888"))
        ax.text(x, 0.6, f"node {n}", ha="center", fontsize=11)
        for j, d in enumerate(per_node[n]):
            y = -j * 1.3 - 0.2
            centre[d] = (x, y)
            ax.add_patch(FancyBboxPatch((x - 0.5, y - 0.4), 1.0, 0.8,
                                        boxstyle="round,pad=0.03", fc=colour[d], ec="#333"))
            ax.text(x, y + 0.08, f"rank {p.ranks[d]}", ha="center", fontsize=10)
            ax.text(x, y - 0.22, f"slice {d}", ha="center", fontsize=8)
    for d in range(p.D):  # keeper -> kept (ARC slice replica, AOR shard)
        ax.add_patch(FancyArrowPatch(centre[d], centre[p.protects(d)], shrinkA=22,
                                     shrinkB=22, connectionstyle="arc3,rad=0.25",
                                     arrowstyle="-|>", mutation_scale=12, color="#c0392b",
                                     lw=1.4))
    groups = "  ".join("[" + " ".join(str(p.ranks[m]) for m in g) + "]"
                       for g in p.parity_groups)
    ax.text(-0.8, -depth * 1.3 - 0.25, "red arrow: keeper -> the rank whose ARC slice "
            "replica and AOR optimizer shard it keeps (the ring)", fontsize=9)
    ax.text(-0.8, -depth * 1.3 - 0.6, f"colour: AEC parity group, one member per node: "
            f"{groups}", fontsize=9)
    ax.set_title(title or f"sharding group {list(p.ranks)} on {len(nodes)} nodes of "
                 f"{ranks_per_node} ranks", fontsize=12)
    ax.set_xlim(-1.0, 2.2 * (len(nodes) - 1) + 1.0)
    ax.set_ylim(-depth * 1.3 - 0.8, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", required=True, help='the group\'s ranks, e.g. "0-7"')
    ap.add_argument("--ranks-per-node", type=int, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args(argv)
    draw(_ranks(a.ranks), a.ranks_per_node, a.output, a.title)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
