"""One rank of bench_overhead.py: the real trainer, with every snapshot method built in
the same processes and taking turns in blocks of iterations (A A A A B B B B ... A A A
A ...), so all methods see the same machine, model and data.

Methods (``--methods``, comma-separated):
  none               no snapshot, as a plain run: no pipeline-event instrumentation either
                     (config.timers and the p2p communicator as the trainer leaves them
                     without REFT), switched off for its blocks
  instrumented       no snapshot, the pipeline-event instrumentation HAS needs installed
  end-of-iteration   REFT snapshot copied right after the optimizer step (blocking)
  host-thread        REFT snapshot copied at once by a background thread
  dcp-async          torch.distributed.checkpoint.async_save into /dev/shm
  mcore-async        megatron-core dist_checkpointing async save into /dev/shm
  has-none|has-arc|has-aec   REFT HAS with that protection (tier 2 as --reft-has-tier2 auto)
  has-none-concurrent        ... with tier 2 forced beside compute
  has-aor|has-arc+aor        REFT HAS with AOR (a host replica of the peer's ZeRO-1 shard)

Each block's first iteration absorbs the hand-over from the previous method and is not
measured. Per method, one JSON line ``[BENCH] {...}`` on rank 0: iteration times (the
slowest rank's, per iteration) and blocking times per snapshot.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402

from megatron.training import optimizer_state, pipeline_events  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.hooks import TrainerHook  # noqa: E402
from megatron.training.reft_integration import MegatronStateAdapter  # noqa: E402
from megatron.training.training import Trainer  # noqa: E402
from reft_ext.config import ReftConfig  # noqa: E402
from reft_ext.save.snapshotter import ReftSnapshotter  # noqa: E402
from reft_ext.save.schedules import make_schedule  # noqa: E402
from reft_ext.report.timeline import PipelineEvents, StepProfile  # noqa: E402

# bench_overhead.py names the job (and removes /dev/shm/*<job>* afterwards, even when a
# run dies); standalone runs use the rendezvous id
JOB = os.environ.get("BENCH_JOB") or f"bench{os.environ.get('TORCHELASTIC_RUN_ID', '')}"[:40]


class Reft:
    def __init__(self, trainer, adapter, schedule, protect, shared=None, concurrent=None,
                 keep=0):
        # one snapshotter per protection (and --reft-keep), shared by the schedules
        # (activate() gives it this method's schedule)
        self.snap = shared or ReftSnapshotter(
            ReftConfig(snapshot_every=1, protect=protect, ranks_per_node=1, schedule="has",
                       keep=keep, job_id=f"{JOB}-{protect}-k{keep}"), adapter, trainer.events)
        self.schedule, self.concurrent = schedule, concurrent
        self.auto = self.snap.concurrent_tier2

    def activate(self):
        s = self.snap
        # the bubble profile must describe this schedule's steps, not the last method's
        # (a blocking copy on one stage shows up as long waits on the other)
        s.events.profile = StepProfile()
        # this method's schedule (its own snapshot thread; HAS listens to the bubbles)
        s.schedule.close()
        s.schedule = make_schedule(self.schedule, s.events, s.bandwidth, s.pipeline,
                                   self.auto if not self.concurrent else True)
        if s.aor is not None:  # AOR ships steps only while its method runs
            s.aor.initialize()

    def deactivate(self):
        self.snap.flush()
        if self.snap.aor is not None:
            self.snap.aor.pause()

    def before_step(self):
        t0 = time.perf_counter()
        self.snap.before_optimizer_step()
        return time.perf_counter() - t0

    def after_step(self, state):
        t0 = time.perf_counter()
        self.snap.maybe_snapshot(state.iteration)
        return time.perf_counter() - t0


class DcpAsync:
    """torch DCP async_save every iteration; the previous save is awaited first."""

    def __init__(self, trainer, group):
        self.trainer, self.group, self.future = trainer, group, None
        pp, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        dp = mpu.get_data_parallel_rank()
        self.root = f"/dev/shm/{JOB}-dcp"
        # model params are replicated across DP (deduplicated by DCP's planner); ZeRO-1
        # shards are this rank's own
        self.keys = [(f"pp{pp}.tp{tp}." if not n.startswith("optim.") else
                      f"pp{pp}.tp{tp}.dp{dp}.") + n for n, _ in trainer.state.state_tensors()]

    def activate(self):
        pass

    def deactivate(self):
        self._wait()

    def _wait(self):
        if self.future is not None:
            self.future.result()
            self.future = None

    def before_step(self):
        return 0.0

    def after_step(self, state):
        t0 = time.perf_counter()
        self._wait()
        sd = {k: t for k, (_, t) in zip(self.keys, state.state_tensors())}
        path = f"{self.root}/it{state.iteration % 2}"
        self.future = dcp.async_save(sd, checkpoint_id=path, process_group=self.group)
        return time.perf_counter() - t0


class McoreAsync:
    """megatron-core dist_checkpointing async save (the trainer's --async-save path)."""

    def __init__(self, trainer):
        from megatron.training.checkpointing import Checkpointer

        args = copy.copy(trainer.args)  # the trainer itself saves nothing
        args.save, args.async_save = f"/dev/shm/{JOB}-mcore", True
        self.ckpt = Checkpointer(args)

    def activate(self):
        pass

    def deactivate(self):
        self.ckpt.maybe_finalize(blocking=True)

    def before_step(self):
        return 0.0

    def after_step(self, state):
        t0 = time.perf_counter()
        self.ckpt.maybe_finalize(blocking=True)  # at most one save in flight
        if torch.distributed.get_rank() == 0:
            old = os.path.join(self.ckpt.args.save, f"iter_{state.iteration - 2:07d}")
            shutil.rmtree(old, ignore_errors=True)
        self.ckpt.save(state)
        return time.perf_counter() - t0


class None_:
    def activate(self):
        pass

    def deactivate(self):
        pass

    def before_step(self):
        return 0.0

    def after_step(self, state):
        return 0.0


class Rotation(TrainerHook):
    """The hook: picks the method of the block, times iterations and blocking."""

    PLAIN = "none"  # the method that runs as a plain run: no instrumentation

    def __init__(self, trainer, methods: dict, block: int, group):
        self.trainer, self.methods, self.block, self.group = trainer, methods, block, group
        # the instrumentation every other method runs with (the snapshot methods need the
        # bubbles; the baselines share it so that only the copy differs between them)
        self.instrumentation = (trainer.events, trainer.fb_kwargs, trainer.config.timers)
        self.names = list(methods)
        self.current = None
        self.t_last = None
        self.results = {n: {"iter_ms": [], "blocked_ms": []} for n in self.names}
        self.pending_block = 0.0

    def _method_for(self, iteration):  # iteration about to run
        return self.names[((iteration - 1) // self.block) % len(self.names)]

    def before_optimizer_step(self, state):
        name = self._method_for(state.iteration + 1)
        if name != self.current:
            if self.current is not None:
                self.methods[self.current].deactivate()
            if torch.distributed.get_rank() == 0:
                print(f"[BENCH-BLOCK] {name} from iteration {state.iteration + 1}", flush=True)
            self._instrument(name != self.PLAIN)
            self.methods[name].activate()
            self.current = name
        self.pending_block = self.methods[name].before_step()

    def _instrument(self, on: bool) -> None:
        """From the next forward-backward on (the block's first iteration, which already
        ran its passes, is not counted): events, p2p communicator and config.timers as
        installed, or as a plain run has them (None, {}, None: megatron-core then builds
        its own communicator and calls no timers)."""
        t = self.trainer
        t.events, t.fb_kwargs, t.config.timers = self.instrumentation if on else (None, {},
                                                                                  None)

    def after_step(self, state):
        name = self.current
        blocked = self.pending_block + self.methods[name].after_step(state)
        now = time.perf_counter()
        first = (state.iteration - 1) % self.block == 0
        if self.t_last is not None and not first:
            self.results[name]["iter_ms"].append(1000 * (now - self.t_last))
            self.results[name]["blocked_ms"].append(1000 * blocked)
        self.t_last = now

    def gathered(self) -> dict:
        """Per iteration the slowest rank's time (the job runs at its pace)."""
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, self.results, group=self.group)
        out = {}
        for n in self.names:
            out[n] = {k: [max(vals) for vals in zip(*(r[n][k] for r in every))]
                      for k in ("iter_ms", "blocked_ms")}
        return out


def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a stuck run
    argv, own = sys.argv[1:], {"--methods": "none", "--block": "4", "--bench-protect": "none"}
    for k in own:
        if k in argv:
            j = argv.index(k)
            own[k] = argv[j + 1]
            del argv[j:j + 2]
    names, block, protect = own["--methods"].split(","), int(own["--block"]), \
        own["--bench-protect"]
    args = parse_args(argv)
    trainer = Trainer(args)
    if trainer.events is not None or trainer.config.timers is not None:
        sys.exit("overhead_probe: the trainer installed instrumentation itself (a --reft-* "
                 "flag?): the 'none' rows would not be a plain run")
    trainer.events = PipelineEvents(torch.distributed.get_rank())
    trainer.fb_kwargs = pipeline_events.install(trainer.config, trainer.events)
    group = torch.distributed.new_group(backend="gloo")
    optimizer_state.ensure_adam_state(trainer.state.optimizer)
    adapter = MegatronStateAdapter(trainer.state, args)
    methods, shared = {}, {}
    for n in names:
        if n in ("none", "instrumented"):  # the rotation switches the instrumentation
            methods[n] = None_()
        elif n == "dcp-async":
            methods[n] = DcpAsync(trainer, group)
        elif n == "mcore-async":
            methods[n] = McoreAsync(trainer)
        else:
            base, _, keep = n.partition("@k")  # has-arc@k3: with --reft-keep 3
            schedule, prot = base.split("-", 1) if base.startswith("has-") else (base, protect)
            concurrent = prot.endswith("-concurrent")  # has-X-concurrent: tier 2 beside compute
            prot = prot.removesuffix("-concurrent").replace("+", ",")  # has-arc+aor
            key = f"{prot}@k{keep or 0}"
            m = Reft(trainer, adapter, schedule, prot, shared.get(key), concurrent,
                     int(keep or 0))
            shared.setdefault(key, m.snap)
            methods[n] = m
    rot = Rotation(trainer, methods, block, group)
    trainer.hooks.append(rot)
    trainer.train()
    if rot.current:
        methods[rot.current].deactivate()
    sizes = {k: s.nbytes for k, s in shared.items()}
    results = rot.gathered()
    if torch.distributed.get_rank() == 0:
        print("[BENCH] " + json.dumps({"results": results, "snapshot_bytes": sizes}),
              flush=True)
    for s in shared.values():
        s.close(remove=True)
    for d in (f"/dev/shm/{JOB}-dcp", f"/dev/shm/{JOB}-mcore"):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
