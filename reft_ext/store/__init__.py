"""Where snapshots live: private shared-memory segments, slots, commit pointers, checksums."""

from reft_ext._exports import lazy_exports

_EXPORTS = {  # module: the names it offers
    "slots": ("SnapshotStore", "sealed", "read_sealed"),
    "commit": ("Committer",),
    "shm": ("ShmSegment", "ShmDirError", "ShmSpaceError"),
    "atomic": ("write_atomic",),
    "paths": ("node_dir", "job_dir"),
    "checksum": ("Checksum", "checksum_all"),
}
__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
