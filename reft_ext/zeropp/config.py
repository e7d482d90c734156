"""ZeRO++ settings for megatron-core's distributed optimizer (ZeRO-1): one ``--zero-<field>``
flag per field, checked here before any work (docs/zeropp.md).

* qwZ (``--zero-quantized-weights``): the parameter all-gather after each optimizer step
  carries int8 block codes + fp32 scales instead of 16-bit values; every rank, the owner
  too, uses the dequantized weights, so data-parallel replicas stay identical.
* qgZ (``--zero-quantized-gradients``): the gradient reduce-scatter becomes a quantized
  all-to-all inside the node, then one across nodes among ranks of the same local index,
  each summed in fp32 in a fixed order (deterministic).
* hpZ (``--zero-hpz-partition-size N``): for ZeRO-1, megatron-core's partial distributed
  optimizer with instances of N ranks (one node): the reduce-scatter and the all-gather
  stay inside the instance, one all-reduce of the shard crosses instances
  (docs/zeropp.md).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from reft_ext.flags import add_flags, flag_values
from reft_ext.zeropp.quant import QMAX


class ZeroPPConfigError(ValueError):
    """A ZeRO++ setting that cannot work; the message names the flag."""


@dataclass
class ZeroPPConfig:
    """ZeRO++ on the distributed optimizer, one ``--zero-<field>`` flag each."""

    FLAG_TITLE = "ZeRO++ (quantized ZeRO-1 communication)"

    quantized_weights: bool = field(default=False, metadata=dict(
        help="qwZ: all-gather the updated parameter shards as int8 block codes + fp32 "
             "scales (needs --bf16 or --fp16 and --use-distributed-optimizer)"))
    quantized_gradients: bool = field(default=False, metadata=dict(
        help="qgZ: reduce-scatter the gradients as a quantized all-to-all inside the node, "
             "then across nodes (fixed summation order, fp32 accumulation)"))
    gradient_bits: int = field(default=8, metadata=dict(
        help="qgZ code width: 8 (int8) or 4 (int4, two per byte)"))
    quant_block_size: int = field(default=256, metadata=dict(
        help="elements per quantization block (one fp32 scale each)"))
    hpz_partition_size: int = field(default=1, metadata=dict(
        help="hpZ: shard the optimizer over partitions of N data-parallel ranks (a node), "
             "replicated across partitions, so the all-gather and reduce-scatter stay "
             "inside the node (megatron-core's partial distributed optimizer; 1 = off)"))
    node_size: int = field(default=0, metadata=dict(
        help="ranks per node for qgZ's two hops (default LOCAL_WORLD_SIZE; tests may "
             "simulate nodes)"))

    def __post_init__(self):
        if self.gradient_bits not in QMAX:
            raise ZeroPPConfigError(f"--zero-gradient-bits: 8 or 4, got {self.gradient_bits}")
        if self.quant_block_size < 2 or self.quant_block_size % 2:
            raise ZeroPPConfigError(f"--zero-quant-block-size: an even number >= 2, got "
                                    f"{self.quant_block_size}")
        if self.hpz_partition_size < 1:
            raise ZeroPPConfigError(f"--zero-hpz-partition-size: >= 1, got "
                                    f"{self.hpz_partition_size}")
        if self.node_size < 0:
            raise ZeroPPConfigError(f"--zero-node-size: >= 0, got {self.node_size}")
        if not self.node_size:
            self.node_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.quantized_gradients

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    def instances(self, dp: int) -> int:
        """megatron-core's ``num_distributed_optimizer_instances`` for hpZ."""
        return dp // self.hpz_partition_size if self.hpz else 1

    def validate(self, *, distributed_optimizer: bool, params_dtype: str,
                 world_size: int, dp: int | None = None) -> None:
        """The combinations that cannot work, refused before any work is done."""
        if not self.enabled and not self.hpz:
            return
        if not distributed_optimizer:
            raise ZeroPPConfigError(
                "--zero-quantized-weights/--zero-quantized-gradients/--zero-hpz-partition-"
                "size: ZeRO++ works on the distributed optimizer's all-gather and "
                "reduce-scatter; add --use-distributed-optimizer")
        if self.quantized_weights and params_dtype == "fp32":
            raise ZeroPPConfigError(
                "--zero-quantized-weights: with fp32 parameters (no --bf16/--fp16) the "
                "optimizer's main params are views of the model params, so dequantizing "
                "the gathered weights would overwrite the master weights; train in --bf16")
        if self.hpz and dp is not None and (dp % self.hpz_partition_size or
                                            dp == self.hpz_partition_size):
            raise ZeroPPConfigError(
                f"--zero-hpz-partition-size {self.hpz_partition_size}: must divide the "
                f"data-parallel size {dp} into 2 or more partitions (one per node)")
        if world_size % self.node_size:
            raise ZeroPPConfigError(f"--zero-node-size {self.node_size}: the world size "
                                    f"{world_size} is not a multiple of it")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls, cls.FLAG_TITLE, prefix="--zero-", dest_prefix="zero_")

    @classmethod
    def from_args(cls, args) -> "ZeroPPConfig":
        try:
            return cls(**flag_values(cls, args, "zero_"))
        except TypeError as exc:  # pragma: no cover - a flag missing from the parser
            raise ZeroPPConfigError(str(exc)) from None
