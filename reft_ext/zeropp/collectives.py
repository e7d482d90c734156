"""ZeRO++'s collectives for a ZeRO-1 optimizer: the replacements of megatron-core's
parameter all-gather and gradient reduce-scatter (module globals ``dist_all_gather_func``
and ``dist_reduce_scatter_func`` of megatron/core/distributed/param_and_grad_buffer.py;
the trainer installs them, megatron/training/zeropp_integration.py).

* :meth:`ZeroPPComm.all_gather` (qwZ): every rank quantizes its updated shard, the codes
  and scales are all-gathered, every shard is dequantized, the owner's own too, so all
  data-parallel replicas compute with the same weights (REFT's replicated slices rely on
  it). 16-bit buffers only: an fp32 parameter is its own master weight.
* :meth:`ZeroPPComm.reduce_scatter` (qgZ): a data-parallel group of M nodes x N ranks,
  member d = n N + l. Hop 1, inside the node: rank (n, l) sends local peer l' the slices
  n' N + l' of every node n' (quantized), and sums what it gets, fp32, in local order;
  hop 2, across nodes among ranks of local index l: the partial sum of slice n' N + l
  goes to rank (n', l), which sums them in node order. Each rank ends with its own
  contiguous shard; the order of every sum is fixed (deterministic). A rank's own data
  never crosses the wire and is not quantized.

megatron-core issues both calls inside ``torch.distributed._coalescing_manager(group)``,
which defers collectives on that group to its exit; these run on duplicates of the
data-parallel group (and its node subgroups) so they complete before returning.
Both count what they put on the wire per rank, inside and across nodes (:attr:`sent`),
quantized or not, so one run can be set beside another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from reft_ext.zeropp.quant import dequantize, quantize


@dataclass
class _Groups:
    """A data-parallel group's duplicates: the whole group, this rank's node subgroup
    and its same-local-index subgroup across nodes."""
    size: int
    nodes: int      # M
    per_node: int   # N
    node: int       # this rank's n
    local: int      # this rank's l
    dup: object
    intra: object
    inter: object


class _Done:
    """The handle of a call that already finished (async callers wait on it)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


class ZeroPPComm:
    """The job's ZeRO++ collectives. ``dp_groups``: every data-parallel group of the job
    (global ranks, the same list on every rank: each rank takes part in creating every
    duplicate); ``node_size``: consecutive ranks per node."""

    def __init__(self, cfg, dp_groups: list[list[int]], node_size: int, backend=None,
                 instances: int = 1):
        self.cfg, self.node_size, self.instances = cfg, node_size, instances
        self.rank = dist.get_rank()
        self.sent = {"weights": {"intra": 0, "inter": 0}, "gradients": {"intra": 0, "inter": 0}}
        self._by_ranks: dict[tuple, _Groups] = {}
        self._by_id: dict[int, _Groups] = {}
        for ranks in dp_groups:
            self._make(sorted(ranks), backend)

    def _make(self, ranks: list[int], backend) -> None:
        nodes: dict[int, list[int]] = {}
        for r in ranks:
            nodes.setdefault(r // self.node_size, []).append(r)
        counts = {len(v) for v in nodes.values()}
        if len(counts) != 1:
            raise ValueError(f"--zero-node-size {self.node_size}: data-parallel group {ranks} "
                             f"has {sorted(len(v) for v in nodes.values())} ranks on its "
                             f"nodes; qgZ needs the same number on every node")
        per_node, order = counts.pop(), sorted(nodes)
        dup = dist.new_group(ranks, backend=backend)
        intra = {n: dist.new_group(nodes[n], backend=backend) for n in order}
        inter = {l: dist.new_group([nodes[n][l] for n in order], backend=backend)
                 for l in range(per_node)}
        if self.rank in ranks:
            n = order.index(self.rank // self.node_size)
            l = nodes[order[n]].index(self.rank)
            self._by_ranks[tuple(ranks)] = _Groups(len(ranks), len(order), per_node, n, l,
                                                   dup, intra[order[n]], inter[l])

    def groups_of(self, group) -> _Groups:
        g = self._by_id.get(id(group))
        if g is None:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            g = self._by_ranks[ranks]
            self._by_id[id(group)] = g
        return g

    def take(self) -> dict:
        """The bytes counted since the last call (the log line's window), reset."""
        out = {k: dict(v) for k, v in self.sent.items()}
        for v in self.sent.values():
            v["intra"] = v["inter"] = 0
        return out

    def _count(self, what: str, intra_bytes: int, inter_bytes: int) -> None:
        self.sent[what]["intra"] += intra_bytes
        self.sent[what]["inter"] += inter_bytes

    # ---- qwZ ------------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None,
                   async_op: bool = False):
        """megatron-core's ``dist_all_gather_func(output, input, group, async_op)``."""
        g = self.groups_of(group)
        n, D = input.numel(), g.size
        peers = (g.per_node - 1, D - g.per_node)  # receivers of this rank's shard
        # fp32 parameters (the local spec's RMSNorm weights) are their own main params in
        # megatron-core's distributed optimizer: dequantizing the owner's shard would
        # change its master weights (and its AOR replica would disagree); gathered exact
        if not self.cfg.quantized_weights or input.dtype == torch.float32:
            dist.all_gather_into_tensor(output, input, group=g.dup)
            per = n * input.element_size()
            self._count("weights", peers[0] * per, peers[1] * per)
            return _Done() if async_op else None
        block = self.cfg.quant_block_size
        codes, scales = quantize(input, 8, block)
        all_codes = torch.empty(D * codes.numel(), dtype=codes.dtype)
        all_scales = torch.empty(D * scales.numel(), dtype=scales.dtype)
        dist.all_gather_into_tensor(all_codes, codes, group=g.dup)
        dist.all_gather_into_tensor(all_scales, scales, group=g.dup)
        cs, ss = all_codes.view(D, -1), all_scales.view(D, -1)
        flat = output.view(-1)
        for d in range(D):  # every shard dequantized, this rank's own too
            dequantize(cs[d], ss[d], n, 8, block, out=flat[d * n:(d + 1) * n])
        per = codes.numel() * codes.element_size() + scales.numel() * 4
        self._count("weights", peers[0] * per, peers[1] * per)
        return _Done() if async_op else None

    # ---- qgZ ------------------------------------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """megatron-core's ``dist_reduce_scatter_func(output, input, op, group,
        async_op)``: SUM or AVG."""
        g = self.groups_of(group)
        D, S = g.size, output.numel()
        if self.instances > 1:  # hpZ: megatron-core then all-reduces the shard across
            # instances itself (a ring, unquantized): counted here, where its size is known
            k = self.instances
            self.sent["gradients"]["inter"] += int(2 * (k - 1) / k * S * output.element_size())
        if not self.cfg.quantized_gradients:
            dist.reduce_scatter_tensor(output, input, op=op, group=g.dup)
            per = S * input.element_size()
            self._count("gradients", (g.per_node - 1) * per, (D - g.per_node) * per)
            return _Done() if async_op else None
        N, M = g.per_node, g.nodes
        x = input.view(M, N, S)
        # hop 1 (inside the node): row l' = the slices n' N + l' of every node n'
        rows = [x[:, lp, :].reshape(-1) for lp in range(N)]
        got = self._exchange(rows, g.intra, g.local, "intra")
        partial = torch.zeros(M * S, dtype=torch.float32)
        for row in got:  # local order 0..N-1
            partial += row
        # hop 2 (across nodes, same local index): the partial of slice n' N + l to node n'
        parts = list(partial.view(M, S))
        got = self._exchange(parts, g.inter, g.node, "inter")
        total = torch.zeros(S, dtype=torch.float32)
        for row in got:  # node order 0..M-1
            total += row
        if op == dist.ReduceOp.AVG:
            total /= D
        output.copy_(total.view(output.shape))
        return _Done() if async_op else None

    def _exchange(self, rows: list[torch.Tensor], group, me: int, where: str) -> list:
        """All-to-all of one row per member (quantized; row ``me`` stays here, exact):
        the rows every member sent this rank, in member order, as fp32."""
        k = len(rows)
        own = rows[me].to(torch.float32)
        if k == 1:
            return [own]
        bits, block = self.cfg.gradient_bits, self.cfg.quant_block_size
        q = [quantize(r, bits, block) for r in rows]
        codes = torch.cat([c for c, _ in q])
        scales = torch.cat([s for _, s in q])
        rc, rs = torch.empty_like(codes), torch.empty_like(scales)
        dist.all_to_all_single(rc, codes, group=group)
        dist.all_to_all_single(rs, scales, group=group)
        n = rows[0].numel()
        out = [own if j == me else
               dequantize(c, s, n, bits, block)
               for j, (c, s) in enumerate(zip(rc.view(k, -1), rs.view(k, -1)))]
        per = q[0][0].numel() * q[0][0].element_size() + q[0][1].numel() * 4
        self.sent["gradients"][where] += (k - 1) * per
        return out
