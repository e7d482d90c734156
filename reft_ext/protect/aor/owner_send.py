"""The owner's send of each step's message (a mixin of
:class:`~reft_ext.protect.aor.transport.AORTransport`): a device owner's sender thread
waits for the posted D2H copy and sends, beside the owner's Adam kernels; the step hook
waits for the previous send only when its holder is a whole step behind (a send
completes once the holder has posted its receive, which its apply thread does when the
message before is applied), and says so once, with the figures."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from reft_ext.protect.aor.startup import TAG_STEP
from reft_ext.report.events import emit
from reft_ext.report.threads import join_or_warn


BEHIND_S = 0.005  # a wait for the previous send longer than this: a holder behind


class OwnerSend:
    """Needs (AORTransport's): ``_send_q``, ``_sender``, ``_send_work``, ``_send_buf``,
    ``_error``, ``owner``, ``group``, ``rank``, ``holder_rank``, ``owner_rank``,
    ``steps``, ``holder_waits``, ``holder_wait_s``."""

    def _start_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="aor-send",
                                            daemon=True)
            self._sender.start()

    def _send_loop(self) -> None:
        """(sender thread, device owner) per step: the posted D2H copy is in host memory,
        the message sent, its send completed. The rank's device is set here first: a
        CUDA call on a thread that never set one would make a context on GPU 0."""
        try:
            torch.cuda.set_device(self.owner.device)
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread
            self._error = exc
        while True:
            seq = self._send_q.get()
            try:
                if seq is None:
                    return
                if self._error is None:
                    self.owner.wait_capture()
                    dist.isend(self._send_buf, dst=self.holder_rank, group=self.group,
                               tag=TAG_STEP).wait()
            except BaseException as exc:  # noqa: BLE001 - raised on the main thread
                self._error = exc
            finally:
                self._send_q.task_done()

    def _wait_send(self, behind_check: bool = False) -> None:
        """The previous message's send has completed (the send buffer is free). It is
        long done unless the holder's replay is a whole step behind: then the training
        thread waits, and says so once, with the figures."""
        t0 = time.perf_counter()
        if self._sender is not None:
            self._send_q.join()
        # Exactly once per send: a gloo SendWork's wait() consumes one completion of its
        # buffer, so a second wait() on the same work blocks forever (seen when a paused
        # transport was initialized again: initialize() and the next step both waited).
        if self._send_work is not None:
            self._send_work.wait()
            self._send_work = None
        waited = time.perf_counter() - t0
        if behind_check and waited > BEHIND_S:
            self.holder_waits += 1
            self.holder_wait_s += waited
            if self.holder_waits == 1:
                emit("aor_holder_behind",
                     f"rank {self.rank}: the holder of its shard (rank {self.holder_rank}) "
                     f"is a whole step behind: its replay of step {self.steps - 1} had not "
                     f"ended by step {self.steps + 1}; the training thread waited "
                     f"{waited * 1e3:.0f} ms for it ({self.owner.spec.message_nbytes} "
                     f"bytes a step; later waits are counted in the AOR summary, not "
                     f"said)", prefix="[AOR]", owner=self.rank, holder=self.holder_rank,
                     iteration=self.steps + 1, waited_ms=round(waited * 1e3, 1),
                     nbytes=self.owner.spec.message_nbytes)

    def _stop_sender(self, timeout_s: float | None = None) -> bool:
        if self._sender is None:
            return True
        self._send_q.put(None)
        if timeout_s is None:
            self._sender.join()
        elif not join_or_warn(self._sender, timeout_s, "the AOR send thread",
                              owner=self.owner_rank):
            return False
        self._sender = None
        return True
