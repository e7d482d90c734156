"""What a rank's training state is: its byte layout (regions), identity and metadata codec."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "StateLayout": "layout",
    "StreamLayout": "layout",
    "Region": "regions",
    "Source": "regions",
    "fingerprint": "identity",
    "refuse_other_runs": "identity",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
