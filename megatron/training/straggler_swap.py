"""``--reft-replace-stragglers``, the trainer's side (the protocol and the supervisor's
part: reft_ext/cluster/straggler_swap.py).

``GoodputTracker`` owns one :class:`SwapControl`: after each straggler exchange it posts
this rank's proposal (its data-parallel group's slowest named node, from the group's
first rank, when the supervisor has a spare), collects the job's agreement at the next
iteration, and names the iteration the swap is taken at (the first one whose snapshot is
taken). There the trainer calls :func:`take_swap`: the snapshot is committed on every
rank, the leaving node's ranks exit with ``EXIT_SWAPPED``, the others restart in process.
"""

from __future__ import annotations

import os
import sys

import torch

from reft_ext.cluster import straggler_swap as swap
from reft_ext.report import events


class SwapControl:
    def __init__(self, args, per_node: int):
        self.per_node = max(1, per_node)
        self.every = max(1, getattr(args, "reft_snapshot_every", 0) or 1)
        self.train_iters = args.train_iters
        self.agreement = swap.Agreement()
        self.due: dict | None = None    # the agreed swap: node, iteration
        self._no_spare_said = False

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def restarted(self) -> None:
        """A new generation: the collective in flight went with the old groups."""
        self.agreement.drop()
        self.due = None

    def after_exchange(self, named: dict[int, dict], speaks: bool, iteration: int) -> None:
        """Every rank, at the same iterations: post the proposal (None but on a group's
        first rank with a named node and a spare to put in its place)."""
        if self.due is not None or self.agreement.pending:
            return
        node = None
        if speaks:
            best = swap.candidate(named, self.node_of)
            if best is not None:
                if self._capacity() >= 1:
                    node = best[0]
                elif not self._no_spare_said:
                    self._no_spare_said = True
                    events.emit("straggler_no_spare", f"straggler: node {best[0]} is not "
                                f"swapped: the in-process supervisor has no warm spare "
                                f"node ready (tools/launch_nodes.py --spares)",
                                node=best[0], iteration=iteration)
        self.agreement.post(node)

    def _capacity(self) -> int:
        from megatron.training.inprocess_generation import generation

        gen = generation()
        return swap.read_capacity(gen.store, gen.secret) if gen is not None else 0

    def poll(self, iteration: int) -> dict | None:
        """Every iteration: the agreement collected (posted an iteration or more ago);
        the swap when its iteration has come (a snapshot iteration before the end)."""
        if self.agreement.pending:
            node = self.agreement.collect()
            if node is not None:
                at = -(-iteration // self.every) * self.every
                self.due = dict(node=node, iteration=at, agreed=iteration)
        if self.due is not None and iteration >= self.due["iteration"] \
                and iteration % self.every == 0:
            if iteration >= self.train_iters:  # the run ends here anyway
                self.due = None
                return None
            return self.due
        return None


def take_swap(trainer, due: dict, detector_named: dict[int, dict]) -> None:
    """The agreed swap, at its iteration, on every rank: commit the snapshot in flight
    (a collective every rank enters), then leave (the node's ranks) or end the
    generation for an in-process restart (everyone else)."""
    s, node = trainer.state, due["node"]
    ctl = trainer.goodput.swap
    ranks = swap.node_ranks(node, ctl.per_node)
    trainer.reft.commit_in_flight()
    rank = torch.distributed.get_rank()
    from megatron.training.inprocess_generation import generation

    gen = generation()
    swap.past_commit(gen, rank)
    ctl.due = None
    if rank == ranks[0]:
        # the detector's entries are keyed by the group's index; each names its rank
        named = {i["rank"]: i for i in detector_named.values()}
        info = next((named[r] for r in ranks if r in named), None)
        left = trainer.args.train_iters - s.iteration
        cost = (info or {}).get("cost_s", 0.0)
        events.emit("straggler_swap", swap.swap_text(node, ranks, info, s.iteration, left),
                    node=node, ranks=ranks, iteration=s.iteration, agreed=due["agreed"],
                    cost_s=cost, ratio=(info or {}).get("ratio", 0.0), saved_s=cost * left)
    if rank in ranks:
        others = [r for r in range(torch.distributed.get_world_size()) if r not in ranks]
        swap.wait_past_commit(gen, others)
        leave(trainer)
    raise swap.PlannedSwap(f"node {node} (ranks {ranks}) swapped out for a spare after "
                           f"iteration {s.iteration}")


def leave(trainer) -> None:
    """This rank's node is swapped out: its goodput so far for the rank's next process
    (which goes on from it, counted as a swap), REFT's session abandoned (the snapshot
    stays in shared memory, the heartbeat ends first so the node watcher judges no
    hang), the abort watcher stopped, and the process ends with EXIT_SWAPPED: the
    supervisor puts a spare in its place."""
    from megatron.training import inprocess

    trainer.goodput.leaving(trainer.state)
    trainer.reft.abandon()
    inprocess.close()
    events.record("swapped_out", iteration=trainer.state.iteration, pid=os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(swap.EXIT_SWAPPED)
