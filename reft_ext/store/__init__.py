"""Where snapshots live: private shared-memory segments, slots, commit pointers, checksums."""

from reft_ext._exports import lazy_exports

_EXPORTS = {
    "SnapshotStore": "slots",
    "sealed": "slots",
    "read_sealed": "slots",
    "Committer": "commit",
    "ShmSegment": "shm",
    "ShmDirError": "shm",
    "ShmSpaceError": "shm",
    "write_atomic": "atomic",
    "node_dir": "paths",
    "job_dir": "paths",
    "Checksum": "checksum",
    "checksum_all": "checksum",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
