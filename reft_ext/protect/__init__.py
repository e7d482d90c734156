"""Surviving a lost node: protection schemes (ARC replicas, AEC/XOR parity) and AOR."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "schemes": ("Protection", "make_protection", "register", "snapshot_regions"),
    "xor": ("xor_encode", "xor_decode"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
