"""Small files that are either absent, the old text or the new text, never torn.

Manifests, commit pointers, node status files and shrink hand-over notes are written
here: a temporary file next to the target (mode 0600: another user never reads a job's
state), then ``os.replace``, which is atomic within one filesystem. The temporary's name
is unpredictable and it is created O_EXCL|O_NOFOLLOW: a file or symbolic link planted in
the directory is never opened, let alone written through. Plain Python (no
torch): the node's watcher and the launcher use it.
"""

from __future__ import annotations

# the implementation lives in the foundation layer (reft_ext/report/files.py: the logs,
# traces and reports write the same way); this module names it for the store's callers
from reft_ext.report.files import tmp_name, write_atomic  # noqa: F401
