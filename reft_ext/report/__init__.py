"""What users see: progress bars, the end-of-run summary, Chrome-trace timelines."""
