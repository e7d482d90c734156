"""ZeRO++ for megatron-core's distributed optimizer (docs/zeropp.md): the block quantizer,
the qwZ all-gather and the two-hop qgZ reduce-scatter, their ``--zero-*`` flags."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "config": ("ZeroPPConfig", "ZeroPPConfigError"),
    "quant": ("quantize", "dequantize"),
    "collectives": ("ZeroPPComm",),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
