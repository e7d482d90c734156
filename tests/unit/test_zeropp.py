"""ZeRO++'s pieces (reft_ext/zeropp/): the block quantizer's bounds, its NaN/Inf rule and
int4 packing; the qwZ all-gather and the two-hop qgZ reduce-scatter on 4 real gloo ranks
(2 simulated nodes x 2): exact sums where the codes are exact, shard r on rank r,
identical replicas after qwZ, NaN propagation, bit-identical reruns; and the flags'
refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reft_ext.zeropp.config import ZeroPPConfig, ZeroPPConfigError
from reft_ext.zeropp.quant import QMAX, dequantize, quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 256])
def test_round_trip_error_is_at_most_half_a_step(bits, block):
    torch.manual_seed(bits * block)
    x = torch.randn(3000) * torch.logspace(-3, 3, 3000)  # blocks of very different scale
    codes, scales = quantize(x, bits, block)
    assert codes.numel() == -(-3000 // block) * block * bits // 8
    y = dequantize(codes, scales, 3000, bits, block)
    step = scales.repeat_interleave(block)[:3000]
    assert ((x - y).abs() <= step / 2 * (1 + 1e-6)).all()
    # absmax / qmax clips nothing: each block's largest element comes back within a step
    for b in range(len(scales)):
        blk = x[b * block:(b + 1) * block]
        i = blk.abs().argmax()
        assert abs(float(blk[i] - y[b * block + i])) <= float(scales[b]) / 2 * 1.000001


def test_exact_codes_rounding_zero_blocks_and_int4_packing():
    x = torch.tensor([7.0, -7.0, 2.5, -2.5, 0.5, 1.5, 3.0, 0.0])
    codes, scales = quantize(x, 4, 8)
    assert scales.tolist() == [1.0] and codes.dtype == torch.uint8 and codes.numel() == 4
    # round half to even: 2.5 -> 2, -2.5 -> -2, 0.5 -> 0, 1.5 -> 2
    assert dequantize(codes, scales, 8, 4, 8).tolist() == [7, -7, 2, -2, 0, 2, 3, 0]
    z, s = quantize(torch.zeros(16), 8, 8)
    assert s.tolist() == [0.0, 0.0] and dequantize(z, s, 16, 8, 8).eq(0).all()
    assert QMAX == {8: 127, 4: 7}


def test_nan_and_inf_make_their_block_nan_never_finite():
    x = torch.ones(24)
    x[3], x[20] = float("nan"), float("-inf")
    y = dequantize(*quantize(x, 8, 8), 24, 8, 8)
    assert torch.isnan(y[:8]).all() and torch.isnan(y[16:]).all()
    assert y[8:16].eq(1).all()


def _worker(rank: int, path: str, case: str, out: str) -> None:
    store = dist.FileStore(path, 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    from reft_ext.zeropp.collectives import ZeroPPComm

    cfg = ZeroPPConfig(quantized_weights=True, quantized_gradients=True,
                       gradient_bits=4 if case == "int4" else 8, quant_block_size=8,
                       node_size=2)
    comm = ZeroPPComm(cfg, [[0, 1, 2, 3]], node_size=2)
    world = dist.new_group([0, 1, 2, 3])
    res = {}
    # qgZ on integers whose every code is exact on both hops: in each block of 8 the
    # rank of local index 0 puts qmax, -qmax at positions 0, 1 and the other rank 0, qmax
    # (each row sent in hop 1 has absmax qmax: scale 1; each node's partial sum too),
    # and values of at most qmax // 2 elsewhere (partial sums stay within qmax)
    qmax = QMAX[cfg.gradient_bits]
    g = torch.Generator().manual_seed(rank)
    grads = torch.randint(-(qmax // 2), qmax // 2 + 1, (4 * 32,), generator=g).float()
    grads[0::8], grads[1::8] = (qmax, -qmax) if rank % 2 == 0 else (0, qmax)
    shard = torch.empty(32)
    comm.reduce_scatter(shard, grads.clone(), group=world)
    res["shard"] = shard.tolist()
    res["grads"] = grads.tolist()
    # qgZ on real values: close to the exact sum, and the same bits when run again
    noisy = torch.randn(4 * 40, generator=g)
    a, b = torch.empty(40), torch.empty(40)
    comm.reduce_scatter(a, noisy.clone(), group=world)
    comm.reduce_scatter(b, noisy.clone(), group=world)
    exact = torch.empty(40)
    dist.reduce_scatter_tensor(exact, noisy.clone(), group=world)
    res["noisy_err"] = float((a - exact).abs().max())
    res["same_bits"] = bool(torch.equal(a, b))
    # qwZ: each rank's shard of a bf16 buffer, gathered; replicas must be identical
    buf = torch.zeros(4 * 48, dtype=torch.bfloat16)
    mine = buf[rank * 48:(rank + 1) * 48]
    mine.copy_(torch.randn(48, generator=g).to(torch.bfloat16))
    if case == "nan" and rank == 2:
        mine[5] = float("nan")
    before = mine.float().clone()
    comm.all_gather(buf, mine, group=world)
    res["weights"] = buf.float().tolist()
    res["own_err"] = float((buf[rank * 48:(rank + 1) * 48].float() - before)
                           .nan_to_num(0).abs().max())
    res["sent"] = comm.sent
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _workers(rank: int, path: str, out: str) -> None:
    for case in CASES:  # one process group per case, in the same 4 processes
        _worker(rank, f"{path}.{case}", case, f"{out}.{case}")


CASES = ("int8", "int4", "nan")


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("zeropp")
    out = str(d / "res")
    mp.spawn(_workers, args=(str(d / "store"), out), nprocs=4, join=True)
    return {c: [json.load(open(f"{out}.{c}.{r}")) for r in range(4)] for c in CASES}


@pytest.mark.parametrize("case", CASES)
def test_quantized_collectives_on_four_gloo_ranks(gloo_results, case):
    res = gloo_results[case]
    grads = torch.tensor([r["grads"] for r in res])
    total = grads.sum(0).view(4, 32)
    for r in range(4):  # shard r on rank r, exact for exactly representable inputs
        assert res[r]["shard"] == total[r].tolist(), r
        assert res[r]["same_bits"]
        # int8: well below the values (~1); int4 steps are coarser
        assert res[r]["noisy_err"] < (0.1 if case != "int4" else 1.0), res[r]["noisy_err"]
    weights = [r["weights"] for r in res]
    as_t = [torch.tensor(w) for w in weights]
    for w in as_t[1:]:  # identical replicas (NaN where NaN)
        assert torch.equal(w.nan_to_num(nan=7e7), as_t[0].nan_to_num(nan=7e7))
    if case == "nan":  # rank 2's block of 8 holding the NaN is NaN everywhere, no more
        blk = as_t[0][2 * 48:3 * 48]
        assert torch.isnan(blk[:8]).all() and not torch.isnan(blk[8:]).any()
        assert not torch.isnan(as_t[0][:2 * 48]).any()
    else:
        assert all(r["own_err"] < 0.05 for r in res)  # the owner uses the dequantized shard
    # bytes on the wire, rank 0: 1 intra-node peer and 2 other-node peers get its codes
    s = res[0]["sent"]
    assert s["weights"]["intra"] * 2 == s["weights"]["inter"] > 0
    assert s["gradients"]["intra"] > 0 and s["gradients"]["inter"] > 0


def test_flags_refuse_what_cannot_work():
    with pytest.raises(ZeroPPConfigError, match="--zero-gradient-bits: 8 or 4"):
        ZeroPPConfig(gradient_bits=2)
    with pytest.raises(ZeroPPConfigError, match="--zero-quant-block-size"):
        ZeroPPConfig(quant_block_size=7)
    cfg = ZeroPPConfig(quantized_weights=True, node_size=2)
    with pytest.raises(ZeroPPConfigError, match="add --use-distributed-optimizer"):
        cfg.validate(distributed_optimizer=False, params_dtype="bf16", world_size=4)
    with pytest.raises(ZeroPPConfigError, match="views of the model params"):
        cfg.validate(distributed_optimizer=True, params_dtype="fp32", world_size=4)
    with pytest.raises(ZeroPPConfigError, match="--zero-hpz-partition-size 4: must divide"):
        ZeroPPConfig(hpz_partition_size=4, node_size=2).validate(
            distributed_optimizer=True, params_dtype="bf16", world_size=4, dp=4)
    hpz = ZeroPPConfig(hpz_partition_size=2, node_size=2)
    hpz.validate(distributed_optimizer=True, params_dtype="bf16", world_size=4, dp=4)
    assert hpz.instances(4) == 2 and ZeroPPConfig().instances(4) == 1
    with pytest.raises(ZeroPPConfigError, match="world size 6 is not a multiple"):
        ZeroPPConfig(quantized_gradients=True, node_size=4).validate(
            distributed_optimizer=True, params_dtype="bf16", world_size=6)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    assert ZeroPPConfig().node_size == 1
