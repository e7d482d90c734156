"""Surviving a lost node: protection schemes (ARC replicas, AEC/XOR parity) and AOR."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "Protection": "schemes",
    "make_protection": "schemes",
    "register": "schemes",
    "snapshot_regions": "schemes",
    "xor_encode": "xor",
    "xor_decode": "xor",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
