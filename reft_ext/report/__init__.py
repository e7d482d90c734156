"""What users see: progress bars, the end-of-run summary, Chrome-trace timelines."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "events": ("emit", "record", "reft_print"),
    "progress": ("Progress",),
    "timeline": ("PipelineEvents", "write_chrome_trace"),
    "summary": ("format_summary",),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
