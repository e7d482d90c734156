"""Where snapshots live: private shared-memory segments, slots, commit pointers, checksums."""
