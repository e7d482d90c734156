"""AOR's pairs brought up: the dedicated gloo group and its message tags, and the
whole-shard transfer that gives every holder its owner's state at start-up or after a
recovery (a replica that already has its owner's checksum is kept, not shipped again).

A mixin of :class:`~reft_ext.protect.aor.transport.AORTransport`, apart from the
per-step shipping, the apply thread and the readers: the start-up runs once per
generation (possibly on a thread of its own, beside the first forward-backward) and
agrees with the whole group on which replicas to keep, the steps run every iteration
between one owner and one holder. It works on the attributes ``AORTransport.__init__``
sets (the group and its ranks, ``owner``, ``alloc``, the replica, the apply queue and
threads, the sequence numbers) and calls the transport's ``wait``, ``_wait_send``,
``_wait_init_send``, ``_install_hooks`` and ``_run`` (its apply thread's loop).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from reft_ext.protect.aor.replica import AORReplica
from reft_ext.protect.aor.shard_layout import host_buffer
from reft_ext.report.events import emit
from reft_ext.report.threads import join_or_warn

TAG_INIT, TAG_STEP = 0xA0F0, 0xA0F1
INIT = object()  # queue mark of the whole-shard receive (in place of a step number)


def new_aor_group(my_ranks: list[int]):
    """A dedicated gloo group for this rank's sharding group (given as its global ranks,
    e.g. megatron's data-parallel group). Collective over the whole job: every rank must
    call it once, at the same point (torch creates every group on every rank)."""
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, sorted(my_ranks))
    groups = []
    for g in gathered:
        if g not in groups:
            groups.append(g)
    mine = None
    for ranks in groups:
        pg = dist.new_group(ranks=ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = pg
    return mine


class TransportStartup:
    """The start-up methods of :class:`~reft_ext.protect.aor.transport.AORTransport`
    (:meth:`initialize`, :meth:`start_initialize` and what they share)."""

    # ---- start-up / after recovery ----------------------------------------------------
    def initialize(self, seed: torch.Tensor | None = None) -> None:
        """Give every holder its owner's full shard state (collective over the group).
        Call at start-up once the owner's state is final (after a checkpoint load or a
        REFT recovery), and again after any recovery that replaced a member.

        ``seed``: the replica this holder believes current (after a REFT recovery, the
        AOR region of the snapshot it restored). It is copied into the replica, and a
        pair whose replica then has its owner's checksum skips the transfer: a
        survivor's replica is kept rather than shipped again (hundreds of MB per rank);
        a lost, stale or corrupt one differs and is sent whole."""
        self._prepare_initialize()
        self._initialize(seed)

    def _prepare_initialize(self) -> None:
        """Before either start-up: the last one over, the replica's queue drained, the
        owner's step hook installed (a step taken before a start-up thread ends waits)."""
        self._join_init()
        if self._thread is not None:
            self.wait()
        self._install_hooks()

    def start_initialize(self, seed: torch.Tensor | None = None, done=None) -> None:
        """:meth:`initialize` on a thread, beside the first forward-backward: at a resume
        the seed copy, the checksums and the owner's pack (hundreds of MB each) are off
        the path to training again. The owner's state cannot change before its first
        step, whose hook waits for the thread, as does every reader of the replica
        (:meth:`wait`). Only this thread uses the AOR group until it is joined, and it
        waits for nobody's main thread: no deadlock with the training's collectives.
        ``done()`` runs on the thread when it succeeded."""
        self._prepare_initialize()

        def run() -> None:
            try:
                self._initialize(seed)
                if done is not None:
                    done()
            except BaseException as exc:  # noqa: BLE001 - raised on the main thread
                self._init_error = exc
        self._init_thread = threading.Thread(target=run, name="aor-init", daemon=True)
        self._init_thread.start()

    def _join_init(self, timeout_s: float | None = None) -> bool:
        """The thread of :meth:`start_initialize` has ended (its failure raised here);
        False only when ``timeout_s`` passed first."""
        t = self._init_thread
        if t is not None:
            if timeout_s is None:
                t.join()
            elif not join_or_warn(t, timeout_s, "the AOR start-up thread",
                                  owner=self.owner_rank):
                return False
            self._init_thread = None
        if self._init_error is not None:  # for every later caller too: the pair is broken
            raise RuntimeError(f"AOR start-up failed: {self._init_error!r}") \
                from self._init_error
        return True

    def _initialize(self, seed: torch.Tensor | None) -> None:
        self._wait_send()
        self._wait_init_send()
        self.owner.materialize()
        specs = [None] * self.D
        seeded = seed is not None
        dist.all_gather_object(specs, (self.owner.spec, seeded), group=self.group)
        peer = specs[self.ranks.index(self.owner_rank)][0]
        holder_seeded = specs[self.ranks.index(self.holder_rank)][1]
        if self.replica is None or self.replica.spec != peer:
            self.replica = AORReplica(peer, self.alloc(peer.nbytes))
        mine = self.owner.spec
        if (peer.torch_version, peer.num_threads) != (mine.torch_version, mine.num_threads):
            self.warnings.append(
                f"rank {self.owner_rank} runs torch {peer.torch_version} with "
                f"{peer.num_threads} threads, this holder {mine.torch_version} with "
                f"{mine.num_threads}: bit identity is not guaranteed (verify will tell)")
            emit("aor_warning", f"rank {self.rank}: WARNING {self.warnings[-1]}", prefix="[AOR]",
                 owner=self.owner_rank, why=self.warnings[-1])
        keep_mine, keep_held = self._keep(seed if seeded else None, holder_seeded)
        self.kept = keep_held  # (tests, the start-up line) the replica was not sent
        # The whole-shard transfer (hundreds of MB after a lost node) goes on while
        # training resumes: the holder's apply thread takes it first, then the steps'
        # messages in order, and every reader of the replica waits for it (wait());
        # the owner's packed copy stays alive with its send, waited before the next
        # whole-shard transfer on this pair (TAG_INIT) and at close.
        self.replica.applied = 0
        if not keep_held:
            self.replica.valid, self.replica.reason = False, "being received from its owner"
            self._q.put((dist.irecv(self.replica.buffer, src=self.owner_rank,
                                    group=self.group, tag=TAG_INIT), INIT))
        else:  # kept: its checksum was its owner's
            self.replica.valid, self.replica.reason = True, ""
            self.exact_step = int(self.replica.step_count())
        if not keep_mine:
            packed = torch.empty(mine.nbytes, dtype=torch.uint8)
            self.owner.pack_state(packed)
            self._init_send = dist.isend(packed, dst=self.holder_rank, group=self.group,
                                         tag=TAG_INIT)
        self.seq_sent = self.seq_recv = 0
        with self._go_cv:  # (transport.py: the replays a bubble lets run, counted anew)
            self._go = -1
        self.steps = int(self.owner.step_count())  # Adam steps taken (= the iteration)
        # pinned where the owner's grads come down from a device (an async D2H target)
        self._send_buf = host_buffer(mine.message_nbytes, pinned=self.owner.on_device)
        self._recv_buf = torch.empty(peer.message_nbytes, dtype=torch.uint8)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="aor-replica",
                                            daemon=True)
            self._thread.start()

    def _keep(self, seed: torch.Tensor | None, holder_seeded: bool) -> tuple[bool, bool]:
        """Which of this rank's two pairs keep their replica: (my holder has my state,
        I have my owner's), equal checksums decided alike on both sides of each pair.
        The live replica is compared first: after a failure inside a forward-backward
        (most of an iteration) it has applied just the restored iteration's step, so it
        already holds the seed's bytes and the seed's copy (hundreds of MB) is saved.
        Members whose live replica differs copy their seed in and compare once more."""
        n = self.replica.spec.nbytes
        mine = self.owner.checksum() if holder_seeded else None
        usable = seed is not None and seed.numel() >= n
        first = [None] * self.D  # (mine as owner, my live replica's, a seed to try)
        dist.all_gather_object(first, (mine, self.replica.checksum() if seed is not None
                                       else None, usable), group=self.group)
        at = {r: first[i] for i, r in enumerate(self.ranks)}
        owner, holder = at[self.owner_rank], at[self.holder_rank]
        keep_mine = holder[1] is not None and holder[1] == mine  # my holder has my state
        keep_held = at[self.rank][1] is not None and at[self.rank][1] == owner[0]
        self.kept_from = "live" if keep_held else ""  # (tests) which bytes were kept
        retry = {r for r, (_, live, can) in at.items()
                 if can and live != at[self._owner_of[r]][0]}
        if not retry:
            return keep_mine, keep_held
        if self.rank in retry:
            self.replica.buffer.copy_(seed[:n])
        second = [None] * self.D
        dist.all_gather_object(second, self.replica.checksum() if self.rank in retry
                               else None, group=self.group)
        again = {r: second[i] for i, r in enumerate(self.ranks)}
        if self.holder_rank in retry:
            keep_mine = again[self.holder_rank] == mine
        if self.rank in retry:
            keep_held = again[self.rank] == owner[0]
            self.kept_from = "seed" if keep_held else ""
        return keep_mine, keep_held
