"""REFT captures an optimizer's state through one table of known kinds
(megatron/training/optimizer_state.py): state a first ``step()`` would create lazily is
created before the snapshot layout is listed, bit-identically; unknown optimizers are
refused by name; state that appears after the listing is refused after the first step.

Real torch optimizers inside megatron's wrapper shape (``.optimizer`` /
``.chained_optimizers``); no process groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.training import optimizer_state as ost
from megatron.training.train_state import TrainingState


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 5, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g))]


def _grads(params, seed):
    """Random grads with exact +0.0 and -0.0 entries: the signed-zero case a +0.0
    momentum buffer would get wrong."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in params:
        t = torch.randn(p.shape, generator=g)
        t.view(-1)[0], t.view(-1)[1] = -0.0, 0.0
        out.append(t)
    return out


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _wrap(opt):
    return SimpleNamespace(optimizer=opt)  # megatron's FP32/Float16 optimizer shape


SGD_SETTINGS = [dict(foreach=False), dict(foreach=True), dict(fused=True),
                dict(foreach=False, nesterov=True), dict(foreach=False, weight_decay=0.1)]


@pytest.mark.parametrize("kw", SGD_SETTINGS)
def test_sgd_momentum_is_listed_before_step_1_and_step_1_is_bit_identical(kw):
    lazy_p, eager_p = _params(), _params()
    lazy = torch.optim.SGD(lazy_p, lr=0.1, momentum=0.9, **kw)
    eager = torch.optim.SGD(eager_p, lr=0.1, momentum=0.9, **kw)
    ost.ensure_state(_wrap(eager))
    listed = [(p, st["momentum_buffer"]) for p, st, keys in ost.captured_states(_wrap(eager))
              for key in keys if key in st]
    assert len(listed) == len(eager_p)  # every buffer exists before step 1
    assert all(not lazy.state[p] for p in lazy_p)  # torch itself creates none yet
    for seed in (1, 2, 3):
        grads = _grads(lazy_p, seed)
        _step(lazy, lazy_p, grads)
        _step(eager, eager_p, grads)
        for a, b in zip(lazy_p, eager_p):
            assert _same(a, b)
            assert _same(lazy.state[a]["momentum_buffer"], eager.state[b]["momentum_buffer"])
    for p, buf in listed:  # the listed tensors are the ones torch went on updating
        assert eager.state[p]["momentum_buffer"] is buf


def test_a_plus_zero_buffer_would_not_be_bit_identical():
    """Why the created buffer holds -0.0: with +0.0, a gradient of -0.0 becomes +0.0
    in the buffer (0*m + -0.0 == +0.0), unlike torch's clone(grad)."""
    g = torch.tensor([-0.0, 1.5])
    plus = torch.zeros(2).mul_(0.9).add_(g)
    minus = torch.full((2,), -0.0).mul_(0.9).add_(g)
    assert not _same(plus, g.clone()) and _same(minus, g.clone())


@pytest.mark.parametrize("cls,kw", [(torch.optim.Adam, {}), (torch.optim.AdamW, {}),
                                    (torch.optim.Adam, dict(amsgrad=True))])
def test_adam_state_is_listed_before_step_1_and_steps_are_bit_identical(cls, kw):
    lazy_p, eager_p = _params(), _params()
    lazy, eager = cls(lazy_p, lr=0.01, **kw), cls(eager_p, lr=0.01, **kw)
    ost.ensure_state(_wrap(eager))
    keys = {k for _, _, ks in ost.captured_states(_wrap(eager)) for k in ks}
    assert keys == {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if kw else set())
    captured = [st[k] for _, st, ks in ost.captured_states(_wrap(eager)) for k in ks]
    ost.FirstStepCheck(_wrap(eager), captured)
    for seed in (1, 2):
        grads = _grads(lazy_p, seed)
        _step(lazy, lazy_p, grads)
        _step(eager, eager_p, grads)  # the post-step check passes: nothing was missed
    for a, b in zip(lazy_p, eager_p):
        assert _same(a, b)
        for k in keys:
            assert _same(lazy.state[a][k], eager.state[b][k])
    assert ost.optimizer_steps(_wrap(eager)) == [2.0]


def test_state_tensor_names_keep_adam_names_and_add_momentum_buffers():
    def names(opt_cls, **kw):
        lin = torch.nn.Linear(3, 2)
        opt = _wrap(opt_cls(lin.parameters(), lr=0.1, **kw))
        state = TrainingState(model=[SimpleNamespace(module=lin)], optimizer=opt,
                              scheduler=None)
        ost.ensure_state(opt)
        return [n for n, _ in state.state_tensors()]

    assert names(torch.optim.Adam) == ["model0.weight", "model0.bias", "optim.exp_avg0",
                                       "optim.exp_avg_sq0", "optim.exp_avg1",
                                       "optim.exp_avg_sq1"]
    assert names(torch.optim.SGD, momentum=0.9)[2:] == ["optim.momentum_buffer0",
                                                        "optim.momentum_buffer1"]
    assert names(torch.optim.SGD, momentum=0.0)[2:] == []  # plain SGD keeps no state


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad])
def test_unsupported_optimizer_is_refused_by_name_before_step_1(cls):
    opt = cls(_params(), lr=0.1)
    with pytest.raises(ost.UnsupportedOptimizer,
                       match=rf"REFT cannot capture the state of torch\.optim\.\w+\."
                             rf"{cls.__name__}; supported: torch\.optim\.Adam/AdamW"):
        ost.ensure_state(_wrap(opt))
    chained = SimpleNamespace(chained_optimizers=[
        _wrap(torch.optim.SGD(_params(), lr=0.1, momentum=0.9)), _wrap(opt)])
    with pytest.raises(ost.UnsupportedOptimizer, match=cls.__name__):
        ost.ensure_state(chained)
    with pytest.raises(ost.UnsupportedOptimizer, match=cls.__name__):
        ost.optimizer_steps(chained)


def test_sgd_with_dampening_is_refused():
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, dampening=0.1)
    with pytest.raises(ost.UnsupportedOptimizer, match=r"SGD with dampening 0\.1"):
        ost.ensure_state(_wrap(opt))


class LazyExtraAdam(torch.optim.Adam):
    """An Adam whose step() creates one more state tensor on its first call: what a
    fused optimizer with a key of its own would do."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("extra_buf", torch.zeros_like(p))
        return out


def test_post_step_check_catches_state_that_appeared_after_listing():
    params = _params()
    opt = _wrap(LazyExtraAdam(params, lr=0.01))
    ost.ensure_state(opt)
    captured = [st[k] for _, st, ks in ost.captured_states(opt) for k in ks]
    ost.FirstStepCheck(opt, captured)
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    with pytest.raises(ost.UnsupportedOptimizer,
                       match=r"LazyExtraAdam holds state 'extra_buf'.*never be snapshotted"):
        opt.optimizer.step()


def test_post_step_check_refuses_lazy_sgd_momentum_that_was_not_ensured():
    """Without ensure_state the layout would miss torch's lazily made momentum buffers:
    the check after the first step refuses instead of letting snapshots go without."""
    params = _params()
    opt = _wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    captured = [st[k] for _, st, ks in ost.captured_states(opt) for k in ks if k in st]
    assert captured == []
    ost.FirstStepCheck(opt, captured)
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    with pytest.raises(ost.UnsupportedOptimizer,
                       match=r"torch\.optim\.sgd\.SGD holds state 'momentum_buffer'"):
        opt.optimizer.step()


def test_post_step_check_catches_a_replaced_state_tensor():
    params = _params()
    opt = _wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    ost.ensure_state(opt)
    captured = [st[k] for _, st, ks in ost.captured_states(opt) for k in ks]
    check = ost.FirstStepCheck(opt, captured)
    opt.optimizer.state[params[1]]["momentum_buffer"] = torch.zeros(5)  # not the listed one
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    with pytest.raises(ost.UnsupportedOptimizer, match=r"'momentum_buffer' \(param 1"):
        opt.optimizer.step()
    check.remove()
    opt.optimizer.step()  # removed: no check any more


class FusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam contract on CPU (apex is not installed here): moments created
    in step() when a param's state is empty, the step count kept in the param group."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if len(st) == 0:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(group["eps"]),
                           value=-group["lr"])


FusedAdam.__module__ = "apex.optimizers.fused_adam"


def test_fused_adam_moments_listed_before_step_1_and_group_step_saved():
    lazy_p, eager_p = _params(), _params()
    lazy, eager = FusedAdam(lazy_p), _wrap(FusedAdam(eager_p))
    ost.ensure_state(eager)
    captured = [st[k] for _, st, ks in ost.captured_states(eager) for k in ks]
    assert len(captured) == 2 * len(eager_p)
    ost.FirstStepCheck(eager, captured)
    assert ost.optimizer_steps(eager) == [{"group_steps": [None]}]
    for seed in (1, 2):
        grads = _grads(lazy_p, seed)
        _step(lazy, lazy_p, grads)
        _step(eager.optimizer, eager_p, grads)
    assert all(_same(a, b) for a, b in zip(lazy_p, eager_p))
    saved = ost.optimizer_steps(eager)
    assert saved == [{"group_steps": [2]}]
    ost.set_optimizer_steps(eager, [{"group_steps": [None]}])  # a snapshot before step 1
    assert "step" not in eager.optimizer.param_groups[0]
    ost.set_optimizer_steps(eager, saved)
    assert eager.optimizer.param_groups[0]["step"] == 2


def test_steps_round_trip_per_kind():
    adam = _wrap(torch.optim.Adam(_params(), lr=0.01))
    sgd = _wrap(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    chained = SimpleNamespace(chained_optimizers=[adam, sgd])
    ost.ensure_state(chained)
    assert ost.optimizer_steps(chained) == [0.0, None]
    ost.set_optimizer_steps(chained, [7.0, None])
    steps = [st["step"] for st in adam.optimizer.state.values()]
    assert [float(s) for s in steps] == [7.0, 7.0] and steps[0] is not steps[1]


def test_cli_refuses_sgd_with_the_distributed_optimizer_and_aor():
    from megatron.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="^--optimizer: sgd with --use-distributed-opt"):
        parse_args(["--optimizer", "sgd", "--use-distributed-optimizer"], world_size=2)
    with pytest.raises(ArgumentError, match="^--reft-protect: aor replays torch's Adam"):
        parse_args(["--optimizer", "sgd", "--reft-snapshot-every", "1",
                    "--reft-protect", "arc,aor"], world_size=2)
    with pytest.raises(ArgumentError, match="^--sgd-momentum"):
        parse_args(["--optimizer", "sgd", "--sgd-momentum", "1.5"], world_size=1)
    args = parse_args(["--optimizer", "sgd", "--sgd-momentum", "0.5"], world_size=1)
    assert (args.optimizer, args.sgd_momentum) == ("sgd", 0.5)
