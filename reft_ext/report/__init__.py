"""What users see: progress bars, the end-of-run summary, Chrome-trace timelines."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "emit": "events",
    "record": "events",
    "Progress": "progress",
    "PipelineEvents": "timeline",
    "write_chrome_trace": "timeline",
    "format_summary": "summary",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
