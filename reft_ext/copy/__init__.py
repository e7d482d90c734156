"""Moving bytes: the copy engine (native or torch) from device/host tensors into shared memory."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "engine": ("CopyEngine", "CopyHandle"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
