"""Swapping a straggler for a warm spare (``--reft-replace-stragglers``): the protocol
between the ranks and the in-process supervisor. The trainer's call sites are in
megatron/training/straggler_swap.py; detection is reft_ext/cluster/stragglers.py.

1. Every ``--reft-straggler-interval`` iterations each data-parallel group's detector
   names its persistently slow ranks (the rows are the group's: every member sees the
   same). The group's first rank proposes the named rank's node (:func:`candidate`)
   when the supervisor has a spare to put in its place (:func:`read_capacity`: the
   supervisor publishes, signed, how many nodes its warm spares can replace now).
2. The proposals meet in one MAX all-reduce of a single int64 over the whole job
   (:class:`Agreement`), posted without waiting and collected an iteration later, so
   no rank waits for it and every rank learns the same node at the same iteration.
3. At the first iteration after that whose snapshot is taken (``--reft-snapshot-every``)
   every rank commits that snapshot job-wide and marks itself past it in the store; the
   others end the generation with :class:`PlannedSwap` and restart in process, the
   node's ranks leave with :data:`EXIT_SWAPPED` once every other rank is past the
   commit (:func:`wait_past_commit`). The supervisor gives the leaving node's slot to the spare
   (``Pool.retire`` then ``take``) as a *planned* generation (not counted against
   ``--max-restarts``), and every rank resumes from the committed iteration: no
   iteration lost, the state bit-identical to a run without the slow node.

The leaving node's snapshot is not the last copy of its state: the flag needs
``--reft-protect arc`` or ``aec``, under which every sharding group survives the loss of
one node (reft_ext/protect/placement.py), and one node is swapped at a time.
"""

from __future__ import annotations

import torch

from reft_ext.cluster.failures import PeerFailure
from reft_ext.cluster.inprocess import key, read_signed, sign

EXIT_SWAPPED = 75  # a rank of a swapped-out node leaves with this (not a failure)
CAPACITY = "spares"  # the supervisor's signed count of nodes its spares can replace


class PlannedSwap(PeerFailure):
    """Another node leaves this generation for a spare (a planned in-process restart):
    this rank restarts in its own process, from the snapshot committed just before."""


# ---- the supervisor's side ---------------------------------------------------------------
def publish_capacity(store, secret: bytes, nodes: int, gen: int) -> None:
    """How many slow nodes the warm spares can replace now (signed, for generation
    ``gen``)."""
    k = key(CAPACITY)
    store.set(k, sign(secret, k, str(int(nodes)), gen))


def read_capacity(store, secret: bytes) -> int:
    """The supervisor's last published capacity (0 when none or not validly signed)."""
    v = read_signed(store, secret, key(CAPACITY))
    return int(v) if v is not None and v.isdigit() else 0


def exits_are_swaps(codes: dict[int, int | None], ranks_per_node: int) -> list[int] | None:
    """The slots (nodes) that left for a swap when every rank that ended did so with
    :data:`EXIT_SWAPPED` and each such slot left whole; else None (a failure)."""
    ended = {r: c for r, c in codes.items() if c is not None}
    if not ended or any(c != EXIT_SWAPPED for c in ended.values()):
        return None
    slots = sorted({r // ranks_per_node for r in ended})
    if any(r not in ended for s in slots for r in range(s * ranks_per_node,
                                                         (s + 1) * ranks_per_node)):
        return None
    return slots


# ---- the ranks' side -----------------------------------------------------------------------
def candidate(named: dict[int, dict], node_of) -> tuple[int, dict] | None:
    """(node, what was said of it) of the slowest named rank, or None. A node swapped
    out before may be proposed again: its slot holds the spare now, judged afresh (the
    detector starts over after every restart); the spares bound how often."""
    best = None
    for rank, info in named.items():
        if best is None or info["ratio"] > best[1]["ratio"]:
            best = (node_of(rank), info)
    return best


class Agreement:
    """The job-wide MAX of each rank's proposal (node + 1; 0: none), one int64 over the
    default group, posted now and collected at the next :meth:`collect`."""

    def __init__(self):
        self._work = self._buf = None

    def post(self, node: int | None) -> None:
        dev = torch.device("cuda", torch.cuda.current_device()) \
            if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        self._buf = torch.tensor([0 if node is None else node + 1], dtype=torch.int64,
                                 device=dev)
        self._work = torch.distributed.all_reduce(self._buf, op=torch.distributed.ReduceOp.MAX,
                                                  async_op=True)

    @property
    def pending(self) -> bool:
        return self._work is not None

    def collect(self) -> int | None:
        """The agreed node (None: no proposal anywhere); waits if still in flight."""
        if self._work is None:
            return None
        self._work.wait()
        v, self._work, self._buf = int(self._buf.item()), None, None
        return v - 1 if v > 0 else None

    def drop(self) -> None:
        """A restart: the generation's collective is gone with its groups."""
        self._work = self._buf = None


def past_commit(gen, rank: int) -> None:
    """This rank is past the swap's commit: no collective of the generation is left
    for it (``gen``: reft_ext/cluster/inprocess.py's Generation)."""
    gen.store.set(key("swapped", gen.gen, rank), "1")


def wait_past_commit(gen, ranks: list[int], timeout_s: float = 60.0) -> bool:
    """(A leaving rank) wait until every rank of ``ranks`` is past the commit: a process
    that exits while a peer still reads the commit's last bytes from it would reset
    that connection under the peer (then the peer redoes an iteration)."""
    import datetime

    try:
        gen.store.wait([key("swapped", gen.gen, r) for r in ranks],
                       datetime.timedelta(seconds=timeout_s))
        return True
    except torch.distributed.DistStoreError:
        return False


def node_ranks(node: int, ranks_per_node: int) -> list[int]:
    return list(range(node * ranks_per_node, (node + 1) * ranks_per_node))


def swap_text(node: int, ranks: list[int], info: dict | None, iteration: int,
              left: int) -> str:
    """The swap's line; ``info``: what the detector said of the node's rank (None where
    the rank that speaks did not see it named: another data-parallel group did)."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    text = (f"straggler swap: node {node} ({who}"
            + (f", {info['ratio']:.2f}x the other ranks' median" if info else "") +
            f") leaves after iteration {iteration}'s snapshot, committed on every rank; a "
            f"warm spare takes its place")
    if info:
        text += (f". It cost the job {1000 * info['cost_s']:.1f} ms per iteration: "
                 f"{info['cost_s'] * left:.1f} s over the {left} iteration(s) left")
    return text
