"""Known answers for every digest REFT writes down, so that the checksum code is checked
against published values and not only against itself.

- XXH3-64 (seed 0): the xxHash reference's sanity vectors (cli/xsum_sanity_check.c,
  XSUM_XXH3_testdata: inputs from XSUM_fillTestBuffer). The flat ``xxh3_64`` checksum and
  the AOR replica's ``checksum_all`` must give exactly those.
- ``xxh3_64/4M`` (reft_ext/store/checksum.py) hashes the 8-byte little-endian chunk
  digests once more. Those inputs are 8 or 16 bytes long, for which XXH3 is a few lines
  (XXH3_len_4to8_64b, XXH3_len_9to16_64b of xxhash.h): written out below, checked
  against the published 6- and 12-byte vectors, and used to compute the expected region
  checksums independently of the code under test.
- CRC-32: the standard check value, CRC-32("123456789") = 0xCBF43926, and a bitwise
  reference for the chunked ``crc32/4M``.
- SHA-256 (FIPS 180-2 examples): the seal of manifests and commit pointers, the identity
  fingerprint and the trainer's ``[HASH]`` state hash, given inputs whose bytes are a
  published vector's.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from reft_ext.store.checksum import CHUNK, Checksum, checksum, checksum_all

M64 = (1 << 64) - 1
PRIME32, PRIME64 = 2654435761, 11400714785074694797

# XSUM_XXH3_testdata, seed 0: (length of the sanity buffer, XXH3_64bits)
XXH3_VECTORS = [
    (0, 0x2D06800538D394C2), (1, 0xC44BDFF4074EECDB), (6, 0x27B56A84CD2D7325),
    (12, 0xA713DAF0DFBB77E7), (24, 0xA3FE70BF9D3510EB), (48, 0x397DA259ECBA1F11),
    (80, 0xBCDEFBBB2C47C90A), (195, 0xCD94217EE362EC3A), (403, 0xCDEB804D65C6DEA4),
    (512, 0x617E49599013CB6B), (2048, 0xDD59E2C3A5F038E0), (2240, 0x6E73A90539CF2948),
    (2367, 0xCB37AEB9E5D361ED)]

SHA256_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
SHA256_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
SHA256_BRACES = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # "{}"


def sanity_buffer(n: int) -> bytes:
    """XSUM_fillTestBuffer: byte i is the top byte of PRIME32 * PRIME64**i (mod 2**64)."""
    out, gen = bytearray(n), PRIME32
    for i in range(n):
        out[i] = gen >> 56
        gen = gen * PRIME64 & M64
    return bytes(out)


# ---- XXH3-64 of 0 and 4..16 bytes, seed 0, written out from the reference -------------
_SECRET = bytes.fromhex(  # XXH3_kSecret, its first 72 bytes
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb")


def _le64(b: bytes, off: int) -> int:
    return struct.unpack_from("<Q", b, off)[0]


def _le32(b: bytes, off: int) -> int:
    return struct.unpack_from("<I", b, off)[0]


def _rotl64(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def xxh3_short(data: bytes) -> int:
    n = len(data)
    if n == 0:  # XXH64_avalanche(secret[56:64] ^ secret[64:72])
        h = _le64(_SECRET, 56) ^ _le64(_SECRET, 64)
        h ^= h >> 33
        h = h * 0xC2B2AE3D27D4EB4F & M64
        h ^= h >> 29
        h = h * 0x165667B19E3779F9 & M64
        return h ^ (h >> 32)
    if 4 <= n <= 8:  # XXH3_len_4to8_64b, then XXH3_rrmxmx
        keyed = (_le32(data, n - 4) + (_le32(data, 0) << 32)) ^ \
            (_le64(_SECRET, 8) ^ _le64(_SECRET, 16))
        h = keyed ^ _rotl64(keyed, 49) ^ _rotl64(keyed, 24)
        h = h * 0x9FB21C651E98DF25 & M64
        h ^= (h >> 35) + n
        h = h * 0x9FB21C651E98DF25 & M64
        return h ^ (h >> 28)
    if 9 <= n <= 16:  # XXH3_len_9to16_64b, then XXH3_avalanche
        lo = _le64(data, 0) ^ _le64(_SECRET, 24) ^ _le64(_SECRET, 32)
        hi = _le64(data, n - 8) ^ _le64(_SECRET, 40) ^ _le64(_SECRET, 48)
        prod = lo * hi
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        h = (n + swapped + hi + ((prod & M64) ^ (prod >> 64))) & M64
        h ^= h >> 37
        h = h * 0x165667919E3779F9 & M64
        return h ^ (h >> 32)
    raise ValueError(f"no short path for {n} bytes")


def test_the_written_out_reference_gives_the_published_vectors():
    """The reference used for the combination step below is itself right: the published
    values of the empty input and of the 6- and 12-byte sanity buffers (its two paths)."""
    published = dict(XXH3_VECTORS)
    for n in (0, 6, 12):
        assert xxh3_short(sanity_buffer(n)) == published[n], n
    assert sanity_buffer(4).hex() == "0052929b"  # PRIME32 >> 56 = 0 first


def crc32_bitwise(data: bytes, crc: int = 0) -> int:
    """CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), one bit at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# ---- flat xxh3_64: the published values themselves -------------------------------------
@pytest.mark.parametrize("n,want", XXH3_VECTORS, ids=[str(n) for n, _ in XXH3_VECTORS])
def test_flat_xxh3_is_the_published_xxh3_64(n, want):
    data = sanity_buffer(n)
    assert checksum(data, "xxh3_64") == want
    assert checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else
                    torch.empty(0, dtype=torch.uint8), "xxh3_64") == want
    # streamed in uneven pieces (the AOR replica hashes tensor by tensor)
    cuts = sorted({0, n, *(k * k % (n + 1) for k in range(1, 9))})
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:])]
    assert checksum_all(pieces, "xxh3_64") == want
    assert checksum_all([b"", *pieces, b""], "xxh3_64") == want


# ---- xxh3_64/4M: chunk digests, 8 bytes little-endian each, hashed once more -----------
def _combined(digests: list[int]) -> int:
    return xxh3_short(struct.pack(f"<{len(digests)}Q", *digests))


@pytest.mark.parametrize("n,want", [v for v in XXH3_VECTORS if v[0] in (0, 6, 195, 2367)],
                         ids=["0", "6", "195", "2367"])
def test_chunked_xxh3_of_one_chunk_hashes_its_digest_again(n, want):
    """A region shorter than a chunk (the empty one too: the checksum of no bytes is the
    digest of one empty chunk) is XXH3 of the published digest's 8 little-endian bytes."""
    assert checksum(sanity_buffer(n), "xxh3_64/4M") == _combined([want])
    assert checksum(sanity_buffer(n)) == _combined([want])  # the default algorithm


def test_chunked_xxh3_hand_computed_values():
    """Two of them as literals (from the reference above): a change of the combination
    rule (byte order, digest width, seed, a second digest for the empty region) changes
    the checksum every manifest in host memory and on disk was written with."""
    assert checksum(b"", "xxh3_64/4M") == 0x9F77619E37E86919
    assert checksum(sanity_buffer(2367), "xxh3_64/4M") == 0x1B4A52FE4CABF923


def test_chunked_xxh3_cuts_at_exactly_4_mib():
    """A region of exactly one chunk has one digest (no empty chunk after it); one byte
    more makes a second chunk. The 4 MiB chunk digests come from the flat XXH3 (checked
    against the published vectors above), the combination from the reference."""
    assert CHUNK == 4 << 20  # the "/4M" in the algorithm's name, stored in manifests
    tail = sanity_buffer(12)
    region = bytes(range(256)) * (CHUNK // 256) + tail
    first = checksum(region[:CHUNK], "xxh3_64")
    assert checksum(region[:CHUNK], "xxh3_64/4M") == _combined([first])
    two = _combined([first, 0xA713DAF0DFBB77E7])  # the 12-byte tail's published digest
    assert checksum(region, "xxh3_64/4M") == two
    # streamed across the chunk boundary in pieces that straddle it
    c = Checksum("xxh3_64/4M")
    for a in range(0, len(region), 3 << 20):
        c.update(torch.frombuffer(bytearray(region[a:a + (3 << 20)]), dtype=torch.uint8))
    assert c.value == two


# ---- CRC-32 --------------------------------------------------------------------------
def test_crc32_is_the_standard_crc32():
    assert checksum(b"123456789", "crc32") == 0xCBF43926 == crc32_bitwise(b"123456789")
    assert checksum(b"", "crc32") == 0
    assert checksum_all([b"1234", b"", b"56789"], "crc32") == 0xCBF43926
    # chunked: the CRC-32 of the chunk CRCs, 8 bytes little-endian each
    assert checksum(b"123456789", "crc32/4M") == \
        crc32_bitwise(struct.pack("<Q", 0xCBF43926)) == 0x7706D6FC
    assert checksum(b"", "crc32/4M") == crc32_bitwise(bytes(8)) == 0x6522DF69


# ---- SHA-256: seals, identity fingerprints, the [HASH] state hash ----------------------
def test_sha256_primitive_is_fips_180_2():
    assert hashlib.sha256(b"").hexdigest() == SHA256_EMPTY
    assert hashlib.sha256(b"abc").hexdigest() == SHA256_ABC
    assert hashlib.sha256(b"{}").hexdigest() == SHA256_BRACES


def test_seal_is_sha256_of_the_canonical_json():
    """The seal of an object is SHA-256 of its JSON with sorted keys and the default
    separators, the seal itself left out: for the empty object, sha256("{}")."""
    from reft_ext.store.slots import SEAL, _digest, sealed

    assert _digest({}) == SHA256_BRACES
    assert json.loads(sealed({})) == {SEAL: SHA256_BRACES}
    assert _digest({SEAL: "anything"}) == SHA256_BRACES  # the seal is not sealed
    obj = {"b": [1, 2], "a": "x"}
    want = hashlib.sha256(b'{"a": "x", "b": [1, 2]}').hexdigest()
    assert _digest(obj) == want and json.loads(sealed(obj))[SEAL] == want


def test_sealed_file_round_trip_and_known_seal(tmp_path):
    from reft_ext.store.slots import SEAL, read_sealed

    p = tmp_path / "m.json"
    p.write_text(json.dumps({SEAL: SHA256_BRACES}))
    assert read_sealed(str(p)) == ({}, None)
    p.write_text(json.dumps({SEAL: SHA256_EMPTY}))  # the digest of "", not of "{}"
    assert read_sealed(str(p)) == (None, f"fails its checksum ({SEAL})")


def test_identity_fingerprint_is_a_sha256_prefix():
    from reft_ext.state.identity import fingerprint

    assert fingerprint({}) == SHA256_BRACES[:16]


class _State:
    def __init__(self, tensors):
        self.tensors = tensors

    def state_tensors(self):
        return self.tensors


def test_state_hash_is_sha256_of_names_and_bytes():
    """params_hash (the [HASH] line, 'equal iff bit-identical') feeds every tensor's name
    and then its raw bytes: no tensors is sha256(""), the name "ab" with the byte "c" is
    sha256("abc"), however the bytes are typed or laid out."""
    from megatron.training.train_state import params_hash

    assert params_hash(_State([])) == SHA256_EMPTY
    assert params_hash(_State([("ab", torch.tensor([ord("c")], dtype=torch.uint8))])) == \
        SHA256_ABC
    assert params_hash(_State([("a", torch.tensor([ord("b")], dtype=torch.int8)),
                               ("", torch.tensor([ord("c")], dtype=torch.uint8))])) == \
        SHA256_ABC
    # two bytes "bc" as one int16 (little-endian), and non-contiguous
    bc = torch.tensor([ord("b") | ord("c") << 8], dtype=torch.int16)
    assert params_hash(_State([("a", bc)])) == SHA256_ABC
    strided = torch.tensor([ord("b"), 0, ord("c"), 0], dtype=torch.uint8)[::2]
    assert not strided.is_contiguous()
    assert params_hash(_State([("a", strided)])) == SHA256_ABC
