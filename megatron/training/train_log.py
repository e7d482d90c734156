"""Megatron-LM's log lines: start-up latency, one line per ``--log-interval`` iterations
(iteration, consumed samples, ms/iter, TFLOP/s per rank and MFU, lr, lm loss, loss scale,
grad norm, skipped/nan), validation loss, TensorBoard scalars under Megatron-LM's names
(training_log, evaluate_and_print_results: each also "vs samples").

An interval a start, restart or rollback cut short is averaged over the iterations this
process ran, as Megatron-LM does, and its line says which ("of iterations 146-150 only").
"""

from __future__ import annotations

import math
import time


from megatron.training.llama_model import num_floating_point_operations
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last


class TrainLogger:
    def __init__(self, args, state):
        self.args, self.state = args, state
        self.reset()
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

    def reset(self) -> None:
        """A new interval: at start, after a restart or a rollback the iterations still
        counted are not the ones that follow (the next line then covers fewer)."""
        self.t_sum, self.n, self.loss_sum, self.loss_n = 0.0, 0, 0.0, 0
        self.skipped = 0

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
        loss_scale = float(s.optimizer.get_loss_scale())
        if self.writer is not None and "lm loss" in loss:
            # Megatron-LM's scalars (training_log), each also against consumed samples
            scalars = {"learning-rate": lr, "batch-size": a.global_batch_size,
                       "lm loss": loss["lm loss"], "loss-scale": loss_scale}
            if grad_norm is not None:
                scalars["grad-norm"] = grad_norm
            self._scalars(scalars)
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
            line += f"lm loss: {self.loss_sum / self.loss_n:.6E} "
            if self.n < a.log_interval:  # a (re)start inside the interval: say so
                line += f"(of iterations {s.iteration - self.n + 1}-{s.iteration} only) "
            line += f"| loss scale: {loss_scale:.1f} | "
        if grad_norm is not None:
            line += f"grad norm: {grad_norm:.3f} | "
        line += (f"number of skipped iterations: {self.skipped:3d} | "
                 f"number of nan iterations: {s.nan_iters:3d} |")
        if self.zeropp is not None:
            from megatron.training.zeropp_integration import bytes_text

            line += bytes_text(self.zeropp, self.n)
        print_rank_last(line)
        if self.writer is not None:  # Megatron's: seconds per iteration, TFLOP/s per GPU
            self.writer.add_scalar("iteration-time", ms / 1000.0, s.iteration)
            self.writer.add_scalar("throughput", tflops, s.iteration)
        # a collective (min/max over ranks); printed, as megatron's Timers.log would only
        # reach an unconfigured logging.info
        text = timers.get_all_timers_string(["forward-backward", "optimizer"],
                                            normalizer=self.n, reset=True)
        if text:
            print_rank_last(text)
        self.reset()

    def _scalars(self, values: dict, suffix: str = "") -> None:
        """Each value by iteration and, as Megatron-LM does, "<name> vs samples"."""
        s = self.state
        for name, v in values.items():
            self.writer.add_scalar(name + suffix, v, s.iteration)
            self.writer.add_scalar(f"{name}{suffix} vs samples", v, s.consumed_train_samples)

    def validation(self, totals: dict) -> None:
        s = self.state
        parts = [f"validation loss at iteration {s.iteration} |"]
        for k, v in totals.items():
            ppl = math.exp(min(20.0, v))
            parts.append(f" {k} value: {v:.6E} | {k} PPL: {ppl:.6E} |")
            if self.writer is not None:  # evaluate_and_print_results' names
                self._scalars({f"{k} validation": v, f"{k} validation ppl": ppl})
        line = "".join(parts)
        bar = "-" * len(line)
        print_rank_last(f"{bar}\n{line}\n{bar}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
