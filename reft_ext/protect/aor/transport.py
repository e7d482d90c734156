"""AOR transport: ship each owner's step inputs to its holder and apply them off the
training thread.

Ring as ARC (reft_ext/protect/placement.py): each member holds the replica of the member
after it on the group's ring, which sits on another node (member (d+1) mod D with one
member per node), so every shard is held once, off its node. One dedicated gloo group per
sharding group (:func:`new_aor_group`) carries only AOR traffic, so it never queues
behind or interleaves with megatron's collectives.

Per optimizer step (a torch ``step`` pre-hook on the owner's first torch optimizer, i.e.
inside megatron's ``optimizer.step()``, after reduce-scatter, unscale and clipping and
before any torch Adam step of this iteration), on the main thread:

1. owner: the previous send has completed (long done: its holder posted that receive
   when it had applied the message before; the training thread waits here only when
   its holder's replay is a whole step behind, and says so once, with the figures),
   pack ``[header | reduced clipped fp32 grads]`` into one buffer and ``isend`` it; a
   device owner only posts the copy to host: its sender thread waits for the copy and
   sends, beside the owner's Adam kernels;
2. holder: queue a token for the owner's next message (no wait).

The holder's apply thread, per token, posts the receive into the (free: the previous
message is applied) buffer, waits for it and applies the step to the replica with
torch's functional Adam (torch ops release the GIL). The training thread never waits
for a replay (only readers do: :meth:`AORTransport.wait`). Communication is posted by
the main thread, the sender and apply threads (p2p of their own tags), and at start-up
by the thread of :meth:`AORTransport.start_initialize`, joined before anything else
posts. Skipped steps (found inf) never reach the torch step on any rank, so no message
is sent or expected.

Call sites (see docs/aor.md): :meth:`AORTransport.initialize` (or ``start_initialize``,
on a thread) on every rank of the group after the owner's state is final at start-up
(after load/recovery, before the first step), :meth:`wait` before anything reads the
replica, :meth:`verify` every N iterations after ``optimizer.step()``, :meth:`close` at
exit.

The start-up (the group, :meth:`~AORTransport.initialize` and the replicas it keeps) is
``startup.py``'s mixin :class:`~reft_ext.protect.aor.startup.TransportStartup`.
"""

from __future__ import annotations

import math
import queue
import threading
import time

import torch
import torch.distributed as dist

from reft_ext.protect.aor.owner import OwnerShard
from reft_ext.protect.aor.owner_send import OwnerSend
from reft_ext.protect.aor.replica import AORReplica
from reft_ext.protect.aor.shard_layout import host_buffer
# the start-up (a mixin of AORTransport) and the pair's group and tags, importable from
# this module as before it was split (workers, docs import new_aor_group from here)
from reft_ext.protect.aor.startup import (INIT, TAG_INIT, TAG_STEP,  # noqa: F401
                                          TransportStartup, new_aor_group)
from reft_ext.protect.placement import place
from reft_ext.report.events import emit
from reft_ext.report.threads import join_or_warn
from reft_ext.testing import fault_point  # the one test injection point (no-op in production)



def _default_alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class AORTransport(TransportStartup, OwnerSend):
    """This rank as owner of its shard and as holder of the replica of the member after
    it on the group's placement ring (reft_ext/protect/placement.py: on another failure
    domain; member d+1 with one member per domain).

    ``torch_optimizers``: the torch optimizers inside megatron's optimizer, in chain order
    (``[c.optimizer for c in optimizer.chained_optimizers]``); ``alloc(nbytes)`` returns
    the replica's host buffer (uint8; e.g. a view of a /dev/shm segment), called once the
    peer's shard size is known.
    """

    def __init__(self, torch_optimizers, group, alloc=None, placement=None):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.D = len(self.ranks)
        if self.D < 2:
            raise ValueError("AOR needs a sharding (data-parallel) group of 2 or more")
        placement = placement or place(self.ranks)
        d = placement.ranks.index(self.rank)
        self.owner_rank = placement.ranks[placement.protects(d)]  # whose shard I hold
        self._owner_of = {placement.ranks[m]: placement.ranks[placement.protects(m)]
                          for m in range(self.D)}  # every member's (_keep)
        self.holder_rank = placement.ranks[placement.holder(d)]   # who holds mine
        self.owner = OwnerShard(torch_optimizers)
        self.alloc = alloc or _default_alloc
        self.replica: AORReplica | None = None
        self.warnings: list[str] = []
        self._hook = None
        self._thread = None
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._send_work = None
        # a device owner's sender thread (waits for the D2H copy, sends) and its queue
        self._sender = None
        self._send_q: queue.Queue = queue.Queue()
        self.hook_s: list[float] = []  # the training thread's time in each step hook
        self.holder_waits = 0  # steps whose hook waited for a holder a whole step behind
        self.holder_wait_s = 0.0
        self._init_send = None  # initialize()'s whole-shard send, in flight
        self._init_thread = None  # start_initialize()'s, until joined
        self._init_error: BaseException | None = None
        self.seq_sent = self.seq_recv = 0
        self.steps = 0  # Adam steps the owner has taken (set again at initialize)
        self.kept = False  # the last initialize kept this holder's replica (not sent)
        self.kept_from = ""  # ... its live bytes ("live") or the seed's ("seed")
        # --reft-aor-verify-every: a replica that is not a bit-identical replay takes its
        # checksum for a verification on the apply thread, right after applying that
        # step (the training thread only compares); step count -> checksum
        self.verify_every = 0
        self._early_sums: dict = {}
        self.exact_step = 0  # the replica's step count when it last equalled its owner
        # (CPU pipelines) a step's replay waits for this rank's next pipeline bubble
        # (:meth:`bubble`, a PipelineEvents listener) instead of running beside the
        # optimizer step, where every rank's step waits for the slowest: issue 57. The
        # next step, or any reader (:meth:`wait`), lets it run at the latest. _go: the
        # last message sequence number the apply thread may apply
        self.defer_to_bubbles = False
        self._go, self._go_cv = -1, threading.Condition()

    # ---- every optimizer step (main thread, inside optimizer.step) ----------------------
    def _install_hooks(self) -> None:
        if self._hook is None and self.owner.opts:
            self._hook = self.owner.opts[0].register_step_pre_hook(self._on_step)

    def _on_step(self, _opt, _args, _kwargs) -> None:
        t0 = time.perf_counter()
        self._allow(self.seq_recv - 1)  # the last step's replay: now at the latest
        self._join_init()  # the start-up's buffers and whole-shard transfers are posted
        spec = self.owner.spec
        self._wait_send(behind_check=True)
        h = 8 * spec.header_len
        self.owner.capture(self._send_buf[:h].view(torch.float64),
                           self._send_buf[h:].view(torch.float32), self.seq_sent)
        if self.owner.on_device:  # the copy overlaps the owner's Adam kernels
            self._start_sender()
            self._send_q.put(self.seq_sent)
        else:  # CPU: the message is complete, send it now
            self._send_work = dist.isend(self._send_buf, dst=self.holder_rank,
                                         group=self.group, tag=TAG_STEP)
        self.seq_sent += 1
        # (tests) this step's message handed to the send, the owner's message not yet
        # received here; the iteration is the step's (the Adam steps taken, this one too)
        self.steps += 1
        fault_point("aor", iteration=self.steps)
        self._raise_if_failed()
        self._q.put((None, self.seq_recv))  # the apply thread posts the receive
        self.seq_recv += 1
        self.hook_s = [*self.hook_s[-63:], time.perf_counter() - t0]

    def _wait_init_send(self) -> None:
        """The whole-shard send of the last initialize has completed (once, as above)."""
        if self._init_send is not None:
            self._init_send.wait()
            self._init_send = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                work, seq = item
                if work is None:  # a step's message: the buffer is free (applied)
                    work = dist.irecv(self._recv_buf, src=self.owner_rank,
                                      group=self.group, tag=TAG_STEP)
                work.wait()
                if seq is INIT:  # the owner's whole shard has landed in the replica
                    self.replica.valid, self.replica.reason = True, ""
                    self.exact_step = int(self.replica.step_count())
                    continue
                self._gate(seq)
                self.replica.apply_message(self._recv_buf, seq)
                self._checksum_early()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the main thread
                self._error = exc
            finally:
                self._q.task_done()

    # ---- when a replay runs (defer_to_bubbles) ---------------------------------------------
    def _allow(self, seq: float) -> None:
        """Messages up to ``seq`` may be applied."""
        if seq > self._go:
            with self._go_cv:
                self._go = max(self._go, seq)
                self._go_cv.notify_all()

    def _gate(self, seq: int) -> None:
        """(apply thread) Wait until message ``seq`` may be applied."""
        if self.defer_to_bubbles and seq > self._go:
            with self._go_cv:
                self._go_cv.wait_for(lambda: seq <= self._go)

    def bubble(self) -> None:
        """This rank waits on pipeline communication: the steps received so far may be
        applied now, on a core the training would leave idle."""
        self._allow(self.seq_recv - 1)

    # (PipelineEvents listener: the snapshotter registers the transport)
    def wait_begin(self, name: str) -> None:
        self.bubble()

    def wait_end(self, name: str) -> None:
        pass

    def _checksum_early(self) -> None:
        """(apply thread) The replica's checksum for the verification of the step just
        applied, where it is not a bit-identical replay: off the training thread."""
        step = int(self.replica.step_count())
        if self.verify_every and not self.replica.spec.bit_identical and \
                self.replica.valid and step % self.verify_every == 0:
            self._early_sums = {step: self.replica.checksum()}

    def exact(self) -> bool:
        """Does the replica hold its owner's exact bytes now? Always for a bit-identical
        replay; for another (a GPU or fused owner) only at the step of its last
        verification, re-sync or start-up transfer (docs/aor.md)."""
        return self.replica.valid and (self.replica.spec.bit_identical or
                                       int(self.replica.step_count()) == self.exact_step)

    def _replay_note(self) -> str:
        spec = self.replica.spec
        if spec.bit_identical:
            return ""
        return " (GPU owner)" if spec.device != "cpu" else \
            f" ({spec.kind}: not replayed bit for bit)"

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"AOR replica thread failed: {self._error!r}") from self._error

    # ---- readers ------------------------------------------------------------------------
    def wait(self) -> bool:
        """Block until every received step is applied; True if the replica is usable.
        Call before reading the replica (snapshot, verify, recovery)."""
        self._join_init()
        self._allow(self.seq_recv - 1)
        self._q.join()
        if self._sender is not None:  # (no send of ours in flight beside a collective)
            self._send_q.join()
        self._raise_if_failed()
        return self.replica.valid

    def reading(self):
        """``with transport.reading():`` excludes a concurrent apply while copying."""
        return self.replica.lock

    def verify(self, iteration: int | None = None) -> dict:
        """Compare this holder's replica with its owner's live shard (collective over the
        group; call on every member after ``optimizer.step()`` of the same iteration). A
        mismatch (or a replica invalidated by a desync) is logged loudly and the replica
        is re-synced: its owner sends its whole current shard, as at :meth:`initialize`
        (the only way a replay that cannot be bit-identical, a GPU owner's, stays exact
        at every verified iteration). Returns the check, before any re-sync."""
        self.wait()
        step = int(self.replica.step_count())
        early = self._early_sums.pop(step, None)
        self._early_sums = {}
        mine = (self.owner.checksum(), self.replica.checksum() if early is None else early,
                self.replica.valid)
        gathered = [None] * self.D
        dist.all_gather_object(gathered, mine, group=self.group)
        expected = gathered[self.ranks.index(self.owner_rank)][0]
        match = mine[1] == expected
        if not match and self.replica.valid:
            self.replica.invalidate(f"checksum mismatch at iteration {iteration}")
            emit("aor_mismatch", f"rank {self.rank}: MISMATCH at iteration {iteration}: replica "
                 f"of rank {self.owner_rank} has checksum {mine[1]:016x}, the owner "
                 f"{expected:016x}{self._replay_note()}",
                 prefix="[AOR]", iteration=iteration, owner=self.owner_rank)
        valid_before = self.replica.valid
        if match and mine[2]:
            self.exact_step = step
        held = gathered[self.ranks.index(self.holder_rank)]
        resync_held = not (match and mine[2])               # I receive my owner's shard
        resync_mine = not (held[1] == mine[0] and held[2])  # my holder receives mine
        if resync_held or resync_mine:
            self._resync(resync_held, resync_mine, iteration)
        return {"iteration": iteration, "owner": self.owner_rank, "match": match,
                "replica": mine[1], "expected": expected, "valid": valid_before,
                "resynced": resync_held, "step": self.replica.step_count()}

    def _resync(self, receive: bool, send: bool, iteration) -> None:
        """Point-to-point full-shard transfer(s) decided identically on both sides of
        each pair (from the gathered checksums); the apply thread is idle (wait())."""
        self._wait_init_send()  # one whole-shard message on the pair at a time
        works = []
        if receive:
            works.append(dist.irecv(self.replica.buffer, src=self.owner_rank,
                                    group=self.group, tag=TAG_INIT))
        if send:
            packed = host_buffer(self.owner.spec.nbytes)
            self.owner.pack_state(packed)
            works.append(dist.isend(packed, dst=self.holder_rank, group=self.group,
                                    tag=TAG_INIT))
        for w in works:
            w.wait()
        if receive:
            self.replica.valid, self.replica.reason = True, ""
            self.exact_step = int(self.replica.step_count())
            emit("aor_resynced", f"rank {self.rank}: replica of rank {self.owner_rank} "
                 f"re-synced from its owner at iteration {iteration} "
                 f"({self.replica.spec.nbytes} bytes)", prefix="[AOR]",
                 iteration=iteration, owner=self.owner_rank)

    def pause(self) -> None:
        """Stop shipping steps (the replica goes stale: :meth:`initialize` again to resume).
        The overhead benchmark uses it to give other methods the same processes."""
        self.wait()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = None

    def traffic_per_step(self) -> int:
        """Bytes this rank sends per optimizer step (one message to its holder)."""
        return self.owner.spec.message_nbytes

    def abandon(self, timeout_s: float = 5.0) -> bool:
        """A failed generation: the owner's step hook off and the replica thread told to
        stop, waiting for no peer (one may be dead; the aborted connections wake a
        receive in flight). True when the thread is gone."""
        self._remove_hooks()
        try:  # the aborted connections wake a start-up thread in a collective too
            if not self._join_init(timeout_s):
                return False
        except RuntimeError:
            pass  # the generation failed anyway
        self._send_work = self._init_send = None
        if not self._stop_sender(timeout_s):
            return False
        self._allow(math.inf)  # a replay waiting for a bubble: to the stop
        if self._thread is not None:
            self._q.put(None)
            if not join_or_warn(self._thread, timeout_s, "the AOR replica thread",
                                owner=self.owner_rank):
                return False
            self._thread = None
        return True

    def close(self) -> None:
        self._join_init()
        if self._thread is not None:
            self.wait()
            self._q.put(None)
            self._thread.join()
            self._thread = None
        self._wait_send()
        self._stop_sender()
        self._wait_init_send()
        self._remove_hooks()


def connect(placement, torch_optimizers, alloc) -> tuple[AORTransport, object]:
    """This rank's AOR set-up (collective over the job): a dedicated gloo group per
    sharding group, the owner's step hook, and the replica of the shard of the member it
    protects (``placement``: the group's, reft_ext/protect/placement.py) in
    ``alloc(nbytes)`` (the failure domain's shared memory). Returns the transport and
    the spec of the shard held here (its ``nbytes`` size the "aor" region of every
    snapshot)."""
    dp_ranks = list(placement.ranks)
    group = new_aor_group(dp_ranks)
    aor = AORTransport(torch_optimizers, group, alloc=alloc, placement=placement)
    specs = [None] * len(dp_ranks)
    dist.all_gather_object(specs, aor.owner.spec, group=group)
    return aor, specs[aor.ranks.index(aor.owner_rank)]
