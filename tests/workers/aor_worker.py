"""Train the real Trainer with the distributed optimizer (ZeRO-1) and an AOR transport on
every rank: each rank holds, in a /dev/shm segment, the replica of the optimizer shard of
its sharding-group neighbour (d+1) mod D, advanced on a background thread from the
owner's reduced, clipped gradient. After every iteration the replica's checksum is
compared with the owner's live shard (``AORTransport.verify``); at the end the owner's
packed state is sent to its holder and compared byte for byte.

Environment (set by tests/integration/test_aor.py):
  AOR_PERTURB="rank:iteration:mode"  on holder ``rank`` at ``iteration``: ``bit`` flips one
      bit of the replica's exp_avg_sq; ``lr`` applies that step with lr larger by a factor
      1 + 2**-20 (a few float32 ulps: a one-ulp change of the float64 lr usually vanishes
      when the kernels cast the step size to float32, and then the state IS identical).
  AOR_VERIFY_EVERY=N  verify every N iterations (default 1; 0 = never, for timing).
      The test then expects a mismatch at that iteration, on that holder only, and the
      replica re-synced from its owner there (matching again from the next one on).

Prints one ``[AOR]`` summary line per rank (parsed by the test)."""

import os
import sys
import time


import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron.training import optimizer_state
from megatron.training.arguments import parse_args
from megatron.training.hooks import TrainerHook
from megatron.training.training import Trainer
from reft_ext.protect.aor.replica import region
from reft_ext.protect.aor.transport import AORTransport, new_aor_group
from reft_ext.store.shm import ShmSegment


class AORProbe(TrainerHook):
    """Trainer hook: verify every iteration, optionally perturb one replica."""

    def __init__(self, trainer, perturb: str):
        self.trainer, self.rank = trainer, dist.get_rank()
        self.job = "aorprobe-" + os.environ.get("TORCHELASTIC_RUN_ID", str(os.getppid()))
        self.seg = None
        dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
        group = new_aor_group(dp_ranks)
        opts = optimizer_state.torch_optimizers(trainer.state.optimizer)
        self.aor = AORTransport(opts, group, alloc=self._alloc)
        t0 = time.time()
        delay = float(os.environ.get("AOR_START_DELAY", "0"))
        if delay:
            # the snapshotter's way: the start-up on a thread, here held back until the
            # first step is well under way (its hook must wait; nothing may be missed)
            inner = self.aor._initialize

            def late(seed):
                time.sleep(delay)
                inner(seed)
                print(f"[AOR] rank {self.rank} start-up thread done after "
                      f"{len(self.grad_norms)} train steps", flush=True)
            self.aor._initialize = late
            self.aor.start_initialize()
        else:
            self.aor.initialize()
        self.init_s = time.time() - t0
        self.results, self.grad_norms, self.apply_s = [], [], []
        self.p_rank = self.p_iter = self.p_mode = None
        self.verify_every = int(os.environ.get("AOR_VERIFY_EVERY", "1"))
        if perturb:
            r, it, self.p_mode = perturb.split(":")
            self.p_rank, self.p_iter = int(r), int(it)
        if self.p_mode == "lr" and self.rank == self.p_rank:
            self._wrap_apply_with_lr_change()
        if not delay:  # (the replica does not exist before the thread has made it)
            self._wrap_apply_timer()
        self._wrap_train_step()

    def _alloc(self, nbytes):
        self.seg = ShmSegment.create(self.job, f"rank{self.rank}-aor-replica", nbytes)
        return self.seg.tensor()

    def _wrap_train_step(self):
        inner = self.trainer.train_step

        def train_step():
            loss, skipped, grad_norm = inner()
            self.grad_norms.append(float(grad_norm))
            return loss, skipped, grad_norm
        self.trainer.train_step = train_step

    def _wrap_apply_timer(self):
        rep, inner = self.aor.replica, self.aor.replica.apply

        def apply(lrs, wds, grads):
            t0 = time.perf_counter()
            inner(lrs, wds, grads)
            self.apply_s.append(time.perf_counter() - t0)
        rep.apply = apply

    def _wrap_apply_with_lr_change(self):
        rep, inner = self.aor.replica, self.aor.replica.apply

        def apply(lrs, wds, grads):
            if rep.applied + 1 == self.p_iter:  # the step message of that iteration
                lrs = [lr * (1.0 + 2.0**-20) for lr in lrs]
            inner(lrs, wds, grads)
        rep.apply = apply

    def after_step(self, state):
        it = state.iteration
        if self.p_mode == "bit" and self.rank == self.p_rank and it == self.p_iter:
            self.aor.wait()
            sq = region(self.aor.replica.buffer, self.aor.replica.spec, "exp_avg_sq")
            with self.aor.reading():
                sq[sq.numel() // 2:sq.numel() // 2 + 1].view(torch.int32).bitwise_xor_(1)
        if it == int(os.environ.get("AOR_REINIT_AT", "0")):
            # pause and initialize again mid-run (as the overhead benchmark does between
            # methods, and recovery does in-process): must neither hang nor diverge
            # AOR_REINIT_SEED=1: each holder offers its own replica as the seed (as a
            # recovery offers its restored snapshot's); odd ranks flip one bit of both
            # the seed and the live replica (sent whole), rank 0 of the live replica
            # only (the seed is kept), rank 2 of neither (the live replica is kept)
            self.aor.pause()
            seed = None
            if os.environ.get("AOR_REINIT_SEED"):
                self.aor.wait()
                seed = self.aor.replica.buffer.clone()
                if self.rank % 2:
                    seed[seed.numel() // 3].bitwise_xor_(4)
                if self.rank != 2:
                    self.aor.replica.buffer[seed.numel() // 5].bitwise_xor_(2)
            self.aor.initialize(seed=seed)
            how = f" {self.aor.kept_from}" if seed is not None else ""
            print(f"[AOR] rank {self.rank} re-initialized after iteration {it} "
                  f"(kept {int(self.aor.kept)}{how})", flush=True)
        if not self.verify_every or it % self.verify_every:
            return
        res = self.aor.verify(it)
        if res["valid"]:
            assert res["step"] == it, f"replica at Adam step {res['step']}, iteration {it}"
        self.results.append(res)

    def compare_full(self) -> bool:
        """The owner's packed state against the holder's replica, byte for byte."""
        aor = self.aor
        aor.wait()
        mine = torch.empty(aor.owner.spec.nbytes, dtype=torch.uint8)
        aor.owner.pack_state(mine)
        theirs = torch.empty(aor.replica.spec.nbytes, dtype=torch.uint8)
        rw = dist.irecv(theirs, src=aor.owner_rank, group=aor.group, tag=7)
        sw = dist.isend(mine, dst=aor.holder_rank, group=aor.group, tag=7)
        rw.wait()
        sw.wait()
        return torch.equal(theirs, aor.replica.buffer)

    def summary(self, clip_grad: float) -> str:
        mism = [r["iteration"] for r in self.results if not r["match"]]
        clipped = sum(1 for g in self.grad_norms if clip_grad / (g + 1.0e-6) < 1.0)
        distinct = len({r["replica"] for r in self.results})
        apply_ms = 1e3 * sum(self.apply_s) / max(1, len(self.apply_s))
        return (f"[AOR] rank {self.rank} holds {self.aor.owner_rank} iterations "
                f"{len(self.results)} matched {len(self.results) - len(mism)} mismatched "
                f"{','.join(map(str, mism)) or '-'} valid {int(self.aor.replica.valid)} "
                f"distinct {distinct} step {self.aor.replica.step_count():.0f} clipped "
                f"{clipped} bytes_per_step {self.aor.traffic_per_step()} shard_numel "
                f"{self.aor.owner.spec.numel} replica_bytes {self.aor.replica.spec.nbytes} "
                f"full_equal {int(self.compare_full())} init_ms {1e3 * self.init_s:.1f} "
                f"apply_ms {apply_ms:.2f} grad_norm {min(self.grad_norms):.3f}.."
                f"{max(self.grad_norms):.3f}")

    def close(self):
        self.aor.close()


def main():
    args = parse_args(sys.argv[1:])
    trainer = Trainer(args)
    probe = AORProbe(trainer, os.environ.get("AOR_PERTURB", ""))
    trainer.hooks.append(probe)
    try:
        trainer.train()
        print(probe.summary(args.clip_grad), flush=True)
        probe.close()
    finally:  # the /dev/shm segment must not outlive a failed run either
        if probe.seg is not None:
            probe.seg.unlink()
    dist.barrier()


if __name__ == "__main__":
    main()
