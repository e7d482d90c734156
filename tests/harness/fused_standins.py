"""CPU stand-ins for apex's FusedAdam and FusedSGD (apex and TransformerEngine cannot be
installed here: no registry has a usable build for this machine). They follow apex's
documented state layout, which TE's copies keep, so REFT's optimizer table and AOR meet
what megatron-core 0.16.1 would build on a GPU node:

* FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
  set_grad_none, capturable): ``defaults`` hold lr, bias_correction, betas, eps,
  weight_decay; ``capturable`` and ``adam_w_mode`` are attributes of the optimizer, not
  of its param groups; ``state[p]`` holds exp_avg and exp_avg_sq (made in step() when
  empty); the step count is ``group["step"]`` (an int, absent before the first step).
* FusedSGD(params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
  materialize_master_grads): torch SGD's defaults; ``state[p]["momentum_buffer"]``,
  made on the first step (first_run: buf = grad), later buf = buf*momentum +
  (1-dampening)*grad.

The arithmetic is the same update in torch ops (not apex's kernels: on a GPU those
differ in rounding, which AOR's verify-and-resync covers either way). Their
``__module__`` names apex's, so the table's class match treats them as apex's."""

from __future__ import annotations

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False,
                 set_grad_none=True, capturable=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            b1, b2 = group["betas"]
            t, lr, wd, eps = group["step"], group["lr"], group["weight_decay"], group["eps"]
            c1 = 1 - b1 ** t if group["bias_correction"] else 1.0
            c2 = 1 - b2 ** t if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if len(st) == 0:
                    st["exp_avg"] = torch.zeros_like(p).float()
                    st["exp_avg_sq"] = torch.zeros_like(p).float()
                g = p.grad if self.adam_w_mode else p.grad + wd * p
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / c2).sqrt().add_(eps)
                update = (st["exp_avg"] / c1) / denom
                if self.adam_w_mode:
                    update = update + wd * p
                p.add_(update, alpha=-lr)


class FusedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            m, damp = group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + group["weight_decay"] * p if group["weight_decay"] else p.grad
                if m != 0:
                    st = self.state[p]
                    if "momentum_buffer" not in st:  # first_run: the buffer is the grad
                        buf = st["momentum_buffer"] = g.clone()
                    else:
                        buf = st["momentum_buffer"]
                        buf.mul_(m).add_(g, alpha=1 - damp)
                    g = g + m * buf if group["nesterov"] else buf
                p.add_(g, alpha=-group["lr"])


for _cls in (FusedAdam, FusedSGD):
    _cls.__module__ = f"apex.optimizers.{_cls.__name__.lower().replace('fused', 'fused_')}"
