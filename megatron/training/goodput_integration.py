"""The trainer's side of goodput accounting and straggler detection (the library parts:
reft_ext/report/goodput.py, reft_ext/plan/measured_goodput.py,
reft_ext/cluster/stragglers.py).

``Trainer.goodput`` is one :class:`GoodputTracker` per process: it lives across
in-process restarts (the trainer object does), and a new process of the same run goes on
from its rank's newest ``goodput`` event in ``$REFT_EVENTS_FILE``. The loop calls it at
each change of what the rank is doing (thin call sites in training_loop.py); every
``--log-interval`` it records the totals and writes TensorBoard scalars, every
``--reft-straggler-interval`` it exchanges the phase times, and at the end rank 0 prints
``[REFT] goodput: ...`` for the whole job (the mean of every rank's figures).

The records go to ``$REFT_EVENTS_FILE`` when it is set, else to a private file of the
job named by its job id (reft_ext/report/goodput.py ``default_path``), so a process
torchrun restarts goes on from them with no variable set; a job that ends normally
removes that file.
"""

from __future__ import annotations

import os
import time

import torch

from megatron.training.straggler_swap import SwapControl
from reft_ext.cluster import stragglers
from reft_ext.cluster.straggler_config import StragglerConfig
from reft_ext.plan import measured_goodput as goodput_view
from reft_ext.report import events, goodput
from reft_ext.report.goodput import PRODUCTIVE, Ledger


class GoodputTracker:
    def __init__(self, args, t_process: float):
        self.args = args
        self.ledger = Ledger(t_process)
        self.cfg = StragglerConfig.from_args(args)
        self.clock = stragglers.PhaseClock() if self.cfg.enabled else None
        self.detector = self._detector()
        self.carried = False
        self.every = max(1, getattr(args, "reft_snapshot_every", 0) or 1)
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.exchange_s, self.exchanges = 0.0, 0  # what detection costs this rank
        self._speaks = False  # the first rank of its data-parallel group (the lines)
        self._pending = None  # the exchange in flight: (Exchange, iteration, members, me)
        # --reft-replace-stragglers (megatron/training/straggler_swap.py)
        self.swap = SwapControl(args, self.per_node) if self.cfg.replace_stragglers \
            else None
        self.due_swap: dict | None = None  # the swap to take at the end of this iteration
        self._path: str | None = None  # where the records go (:meth:`records_path`)
        self._own_file = False  # the default file (removed at a normal end)

    def _detector(self) -> stragglers.Detector:
        c = self.cfg
        return stragglers.Detector(c.straggler_threshold, c.straggler_window,
                                   c.straggler_interval)

    # ---- what the rank is doing -------------------------------------------------
    def switch(self, category: str) -> None:
        self.ledger.switch(category)

    def rebook_wait(self, seconds: float) -> None:
        """Seconds booked "snapshot" that REFT's hooks spent waiting for the slowest rank
        (waiting the training's own collectives do without REFT): productive."""
        if seconds > 0:
            self.ledger.move("snapshot", PRODUCTIVE, seconds)

    def phase(self, category: str):
        return self.ledger.phase(category)

    def loading(self, start: bool) -> None:
        self.ledger.loading(start)

    def failed(self, planned: bool = False) -> None:
        self.ledger.failed(planned)

    def recovered(self, iteration: int) -> None:
        """A new generation: the exchange and agreement in flight went with the old
        groups; the job's ranks are others (a swap, a replacement): judged anew."""
        self.ledger.restored(iteration)
        if self.clock is not None:
            self.clock.restart()
        self._pending, self.due_swap = None, None
        self.detector = self._detector()
        if self.swap is not None:
            self.swap.restarted()

    def rolled_back(self, iteration: int) -> None:
        self.ledger.rolled_back(iteration)

    def training(self, state) -> None:
        """Training (re)starts: the first time in this process, go on from this rank's
        newest record of an earlier attempt of the same run (a restarted process)."""
        if self.clock is not None:
            self.clock.restart()
        if self.carried:
            return
        self.carried = True
        prev = goodput.previous(self.records_path(), state.extra.get("run_id"),
                                torch.distributed.get_rank(), os.getpid())
        if prev is not None:
            self.ledger.carry(prev, state.iteration)

    def records_path(self) -> str | None:
        """``$REFT_EVENTS_FILE``, else the job's private default file (None where its
        directory cannot be this user's: the books then stay this process's)."""
        if self._path is None:
            env = os.environ.get(events.ENV)
            if env:
                self._path = env
            else:
                from reft_ext.config import ReftConfig

                job = ReftConfig.from_args(self.args).job_id
                self._path = goodput.prepare_default(goodput.default_path(job)) or ""
                self._own_file = bool(self._path)
        return self._path or None

    def begin_iteration(self, iteration: int) -> None:
        self.ledger.begin_iteration()
        if self.clock is not None:
            self.clock.begin(iteration)

    def wrap_finalize(self, finalize):
        return self.clock.wrap_finalize(finalize) if self.clock is not None else finalize

    def optimizer_begin(self) -> None:
        if self.clock is not None:
            self.clock.optimizer_begin()

    def optimizer_end(self) -> None:
        if self.clock is not None:
            self.clock.end()

    # ---- every iteration: exchanges, records, scalars -----------------------------
    def iteration_done(self, state, writer) -> None:
        it = state.iteration
        self.ledger.end_iteration(it)
        if self.swap is not None:  # the agreement posted at an earlier exchange
            self.due_swap = self.swap.poll(it)
        if self._pending is not None:  # the exchange posted an iteration ago
            self._observe(*self._pending, writer)
            self._pending = None
        if self.clock is not None and it % self.cfg.straggler_interval == 0:
            self._post(it)
        if it % self.args.log_interval == 0:
            self._record(state)
            if writer is not None:
                t = self.ledger.totals()
                wall = max(1e-9, sum(t.values()))
                writer.add_scalar("goodput", 100.0 * t[PRODUCTIVE] / wall, it)
                for cat, s in t.items():
                    writer.add_scalar(f"goodput/{cat}-percent", 100.0 * s / wall, it)

    def _node(self, rank: int) -> int | None:
        return rank // self.per_node if self.per_node > 0 else None

    def _post(self, it: int) -> None:
        from megatron.core import parallel_state as mpu

        group = mpu.get_data_parallel_group()  # who waits for whom in the gradient sync
        t0 = time.perf_counter()
        ex = stragglers.Exchange(self.clock.window(), group)
        self.exchange_s += time.perf_counter() - t0
        self.exchanges += 1
        self._pending = (ex, it, torch.distributed.get_process_group_ranks(group),
                         torch.distributed.get_rank(group))

    def _observe(self, ex, it: int, members: list[int], me: int, writer) -> None:
        """The rows of the exchange posted at iteration ``it``, judged."""
        t0 = time.perf_counter()
        rows = ex.rows()
        self.exchange_s += time.perf_counter() - t0
        rep = self.detector.observe(rows, it)
        # waiting for a rank the detector names slow (its index in the group); waiting
        # for a rank nobody named is the sync's ordinary cost: stays productive
        slow = [r for r in self.detector.named if r != me]
        if slow:
            sub = [rows[r] for r in slow] + [rows[me]]
            self.ledger.move(PRODUCTIVE, "straggler_wait", stragglers.waited(sub, len(slow)))
        for info in rep["named"] + rep["cleared"]:  # the group's index -> global rank
            info["rank"] = members[info["rank"]]
        if rep["slowest"] is not None:
            rep["slowest"] = members[rep["slowest"]]
        self._speaks = me == 0  # the group's first rank speaks for it
        if me == 0:  # the group's exchange, for tools and benchmarks (no line)
            events.record("straggler_exchange", iteration=it, slowest=rep["slowest"],
                          ratio=rep["ratio"], group=members,
                          busy_ms=[round(1000 * (r[0] + r[1]), 3) for r in rows])
        th = self.cfg.straggler_threshold
        for event, info, say in ([("straggler", i, stragglers.named_text) for i in rep["named"]]
                                 + [("straggler_cleared", i, stragglers.cleared_text)
                                    for i in rep["cleared"]] if self._speaks else []):
            node = self._node(info["rank"])
            events.emit(event, say(info, th, node), **info, node=node, iteration=it)
        if writer is not None and rep["slowest"] is not None:
            writer.add_scalar("stragglers/slowest-ratio", rep["ratio"], it)
            writer.add_scalar("stragglers/slowest-rank", rep["slowest"], it)
            writer.add_scalar("stragglers/slow-ranks", len(self.detector.named), it)
            named = [v["cost_s"] for v in self.detector.named.values()]
            writer.add_scalar("stragglers/cost-ms-per-iteration",
                              1000.0 * max(named, default=0.0), it)
        if self.swap is not None:
            self.swap.after_exchange({i["rank"]: i for i in self.detector.named.values()},
                                     me == 0, it)

    def leaving(self, state) -> None:
        """This rank's node is swapped out: its books for the process that takes over."""
        self.ledger.switch(self.ledger.current)
        self._record(state, swapped_out=True)

    def _record(self, state, **extra) -> dict:
        rec = self.ledger.record(run=state.extra.get("run_id"), iteration=state.iteration,
                                 pid=os.getpid(), snapshot_every=self.every, **extra)
        path = self.records_path()
        if path:
            events.record(goodput.EVENT, into=path, **rec)
        return rec

    # ---- the end ----------------------------------------------------------------
    def finish(self, state) -> None:
        """Every rank: the final record; rank 0: the job's line (one all_gather_object,
        every rank is here)."""
        if self._pending is not None:  # every rank posted it: read, not judged
            self._pending[0].rows()
            self._pending = None
        if self.swap is not None:  # the same for a proposal in flight
            self.swap.agreement.collect()
        self.ledger.switch(self.ledger.current)
        rec = self._record(state, final=True, exchange_s=self.exchange_s,
                           exchanges=self.exchanges)
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, rec)
        if self._own_file and os.environ.get("LOCAL_RANK", "0") == "0":
            try:  # the job is over: no restarted process will look for its books
                os.unlink(self._path)
            except OSError:
                pass
        if torch.distributed.get_rank() == 0:
            total = goodput.job_totals([r for r in every if r])
            events.emit("goodput_job", goodput_view.line(total, self.every), **total)
        if self.detector.cost_s and self._speaks:
            events.emit("straggler_cost", f"stragglers cost the job "
                        f"{self.detector.cost_s:.2f} s over the run ({len(self.detector.named)}"
                        f" still slow; data-parallel group of rank "
                        f"{torch.distributed.get_rank()})", seconds=self.detector.cost_s)
