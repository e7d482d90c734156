"""What a rank's training state is: its byte layout (regions), identity and metadata codec."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "layout": ("StateLayout", "StreamLayout"),
    "regions": ("Region", "Source"),
    "identity": ("fingerprint", "refuse_other_runs"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
