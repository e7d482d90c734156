"""Megatron-LM's log lines: start-up latency, one line per ``--log-interval`` iterations
(iteration, consumed samples, ms/iter, TFLOP/s per rank and MFU, lr, lm loss, grad norm,
skipped/nan), validation loss, TensorBoard scalars."""

from __future__ import annotations

import math
import time


from megatron.training.llama_model import num_floating_point_operations
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last


class TrainLogger:
    def __init__(self, args, state):
        self.args, self.state = args, state
        self.t_sum, self.n, self.loss_sum, self.loss_n = 0.0, 0, 0.0, 0
        self.skipped = 0
        self.zeropp = None  # ZeroPPComm (--zero-*): its bytes on the wire per step
        self.writer = None
        if args.tensorboard_dir and is_last_rank():
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: "
                                   "pip install tensorboard") from exc
            from megatron.training.path_checks import open_private_dir

            # checked at start (path_checks.py); the writer names its files in the held
            # directory, never through a path another user could swap since
            self.tb_dir = open_private_dir(args.tensorboard_dir)
            self.writer = SummaryWriter(log_dir=self.tb_dir.proc_path, max_queue=1000)

    def startup(self, seconds: float, split: str = "") -> None:
        print_rank_0(f"[after model, optimizer and data are built] time from process start "
                     f"to first iteration: {seconds:.2f} s ({split} s)")

    def iteration(self, loss: dict, grad_norm, skipped: int, seconds: float, timers) -> None:
        a, s = self.args, self.state
        self.t_sum += seconds
        self.n += 1
        self.skipped += skipped
        if "lm loss" in loss and math.isfinite(loss["lm loss"]):
            self.loss_sum += loss["lm loss"]
            self.loss_n += 1
        lr = s.optimizer.param_groups[0]["lr"] if s.optimizer.param_groups else 0.0
        if self.writer is not None and "lm loss" in loss:
            self.writer.add_scalar("lm loss", loss["lm loss"], s.iteration)
            self.writer.add_scalar("learning-rate", lr, s.iteration)
            if grad_norm is not None:
                self.writer.add_scalar("grad-norm", grad_norm, s.iteration)
        if s.iteration % a.log_interval:
            return
        ms = 1000.0 * self.t_sum / self.n
        flops = num_floating_point_operations(a, a.global_batch_size)
        tflops = flops / (ms / 1000.0) / a.world_size / 1e12
        line = (f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {s.iteration:8d}/"
                f"{a.train_iters:8d} | consumed samples: {s.consumed_train_samples:12d} | "
                f"elapsed time per iteration (ms): {ms:.1f} | "
                f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f} | ")
        if a.peak_tflops:
            line += f"MFU: {100.0 * tflops / a.peak_tflops:.2f}% | "
        line += f"learning rate: {lr:.6E} | global batch size: {a.global_batch_size:5d} | "
        if self.loss_n:
            line += f"lm loss: {self.loss_sum / self.loss_n:.6E} | "
        if grad_norm is not None:
            line += f"grad norm: {grad_norm:.3f} | "
        line += (f"number of skipped iterations: {self.skipped:3d} | "
                 f"number of nan iterations: {s.nan_iters:3d} |")
        if self.zeropp is not None:
            from megatron.training.zeropp_integration import bytes_text

            line += bytes_text(self.zeropp, self.n)
        print_rank_last(line)
        if self.writer is not None:
            self.writer.add_scalar("iteration-time-ms", ms, s.iteration)
            self.writer.add_scalar("throughput-tflops", tflops, s.iteration)
        # a collective (min/max over ranks); printed, as megatron's Timers.log would only
        # reach an unconfigured logging.info
        text = timers.get_all_timers_string(["forward-backward", "optimizer"],
                                            normalizer=self.n, reset=True)
        if text:
            print_rank_last(text)
        self.t_sum, self.n, self.loss_sum, self.loss_n, self.skipped = 0.0, 0, 0.0, 0, 0

    def validation(self, totals: dict) -> None:
        s = self.state
        parts = [f"validation loss at iteration {s.iteration} |"]
        for k, v in totals.items():
            ppl = math.exp(min(20.0, v))
            parts.append(f" {k} value: {v:.6E} | {k} PPL: {ppl:.6E} |")
            if self.writer is not None:
                self.writer.add_scalar(f"{k} validation", v, s.iteration)
        line = "".join(parts)
        bar = "-" * len(line)
        print_rank_last(f"{bar}\n{line}\n{bar}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
