"""Checksums of snapshot regions.

The default, ``xxh3_64/4M``, is a two-level hash: xxh3-64 of every 4 MiB chunk of a
region, then xxh3-64 of the chunk digests (8 bytes little-endian each). The HAS scheduler
copies a region chunk by chunk in whatever order the pipeline bubbles allow and hashes
each chunk right after copying it (xxhash releases the GIL), so the region's checksum is
ready when its last chunk lands, without a second pass and without ordering the chunks.
Flat ``xxh3_64`` and ``crc32`` (and ``crc32/4M`` when xxhash is missing) stay readable;
every manifest names its algorithm, so a snapshot is verified with the function that
wrote it."""

from __future__ import annotations

import struct
import zlib

import torch

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

CHUNK = 4 << 20
DEFAULT = "xxh3_64/4M" if xxhash is not None else "crc32/4M"
FLAT = "xxh3_64" if xxhash is not None else "crc32"  # one pass, no chunking (AOR)
ALGORITHMS = ("xxh3_64/4M", "crc32/4M", "xxh3_64", "crc32")


def _buf(piece):
    """The bytes of a host piece. A device tensor is refused, not synced and copied here:
    a hidden device->host copy would stall the training stream (copy it to host memory
    first, e.g. through reft_ext/copy/staging.py, where the stall can be placed)."""
    if not isinstance(piece, torch.Tensor):
        return piece
    if piece.device.type != "cpu":
        raise ValueError(f"checksum of a {piece.device} tensor: only host tensors are hashed; "
                         f"copy it to host memory first (reft_ext/copy/staging.py to_host)")
    return piece.numpy()


def _flat(algorithm: str):
    if algorithm.startswith("xxh3_64"):
        if xxhash is None:
            raise RuntimeError("snapshot was written with xxh3_64 but xxhash is missing: "
                               "pip install xxhash")
        return xxhash.xxh3_64
    if algorithm.startswith("crc32"):
        return None
    raise ValueError(f"unknown checksum {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def chunk_digest(piece, algorithm: str = DEFAULT) -> int:
    """Digest of one chunk (GIL released for large buffers by xxhash and zlib)."""
    h = _flat(algorithm)
    return h(_buf(piece)).intdigest() if h is not None else zlib.crc32(_buf(piece))


def combine(digests: list[int], algorithm: str = DEFAULT) -> int:
    """Region checksum from its chunk digests, in chunk order."""
    blob = struct.pack(f"<{len(digests)}Q", *digests)
    h = _flat(algorithm)
    return h(blob).intdigest() if h is not None else zlib.crc32(blob)


class Checksum:
    """Streaming checksum over byte pieces (uint8 CPU tensors or bytes) of any sizes."""

    def __init__(self, algorithm: str = DEFAULT):
        self.algorithm = algorithm
        self.chunked = algorithm.endswith("/4M")
        h = _flat(algorithm)
        self._new = (lambda: h()) if h is not None else None
        self._digests: list[int] = []
        self._fill = 0  # bytes in the current chunk
        self._reset()

    def _reset(self):
        self._h = self._new() if self._new else None
        self._crc = 0

    def _update_flat(self, buf):
        if self._h is not None:
            self._h.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def _digest(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc

    def update(self, piece) -> "Checksum":
        buf = memoryview(_buf(piece)).cast("B")
        if not self.chunked:
            self._update_flat(buf)
            return self
        while len(buf):
            take = min(len(buf), CHUNK - self._fill)
            self._update_flat(buf[:take])
            self._fill += take
            buf = buf[take:]
            if self._fill == CHUNK:
                self._digests.append(self._digest())
                self._fill = 0
                self._reset()
        return self

    @property
    def value(self) -> int:
        if not self.chunked:
            return self._digest()
        digests = self._digests + ([self._digest()] if self._fill or not self._digests else [])
        return combine(digests, self.algorithm)


def checksum(piece, algorithm: str = DEFAULT) -> int:
    return Checksum(algorithm).update(piece).value


def checksum_all(pieces, algorithm: str = FLAT) -> int:
    """One checksum over the pieces laid end to end (uint8 CPU tensors or bytes)."""
    c = Checksum(algorithm)
    for p in pieces:
        c.update(p)
    return c.value
