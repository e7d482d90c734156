"""A torch.distributed Store whose values carry an HMAC under the job's secret.

torch's TCPStore has no login: any process that reaches its port can write any key. The
process groups of a job rendezvous through such a store (gloo: each rank's peer address
under ``<prefix>/<rank>``; NCCL: the unique id), and the agents of torchrun publish the
workers' ``MASTER_ADDR``/``MASTER_PORT`` in one. A forged value there points a rank at an
address of the writer's choosing, and what a "peer" sends through
``all_gather_object`` is unpickled. :class:`SignedStore` wraps such a store: every value
it sets is ``MAGIC + HMAC-SHA256(secret, scope, round, key, value) + round + value``, and
``get`` returns only values whose tag verifies for its own round. A value without a valid
tag is ignored (one warning per key): ``get`` looks again until the job's own value is
there (one written before the job's, which the job's ``set`` then replaces) or the store's
timeout passes (one written after it: the job's value is gone, the wait fails; the forged
address is never used).

``scope`` names what the values belong to (the store prefix), so a value cannot be moved
to another key; ``round_id`` names the round or generation they belong to (the rendezvous
round with the round's master address and port; the in-process generation), so a value
sealed in one round and written again into the next round's store (a replay: the store has
no login, its keys are listed by anyone) does not verify there either. The round is kept in
clear beside the tag, so a replayed value is said as one "from another round", once per key.
Counters (``add``) stay plain: a forged count can delay a barrier, not redirect a rank.
The wrapper is a Python subclass of ``torch.distributed.Store``: gloo and NCCL call it
from C++ (measured on torch 2.13: gloo uses set, wait, get and clone).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import time

import torch

MAGIC = b"RS2\0"  # then the tag, the round's length (1 byte), the round, the value
TAG_BYTES = 32
POLL_S = 0.05
SECRET_BYTES = 32  # a job's HMAC key: 32 random bytes, hex in the environment


def env_secret(var: str) -> tuple[bytes | None, str]:
    """(the key, "") from environment variable ``var``, or (None, why): "not set" or
    "not 32 hex bytes". The caller's error names what to do."""
    raw = os.environ.get(var, "")
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < SECRET_BYTES:
        return None, "not 32 hex bytes" if raw else "not set"
    return secret, ""

_warned: set[tuple[str, bool]] = set()  # (scope/key, forged rather than replayed)
# every SignedStore made in this process. C++ (gloo, PrefixStore) holds only the C++ side
# of a Python store and finds its methods through the Python object: once that is
# collected, a call from C++ fails ("Not implemented"). A process makes a few (one per
# generation, attempt or rendezvous round), so each is kept for the process's life.
_alive: list = []


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # std::vector<uint8_t> from C++
        return bytes(value)
    return str(value).encode()


def tag(secret: bytes, scope: str, key: str, value: bytes, round_id: str = "") -> bytes:
    msg = b"\0".join((scope.encode(), round_id.encode(), key.encode(), value))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def seal(secret: bytes, scope: str, key: str, value, round_id: str = "") -> bytes:
    """``value`` as stored under ``key`` in ``scope`` for round ``round_id``: magic, tag,
    the round (length-prefixed), value."""
    value, rid = _bytes(value), round_id.encode()
    if len(rid) > 255:
        raise ValueError(f"round id {round_id!r}: at most 255 bytes")
    return MAGIC + tag(secret, scope, key, value, round_id) + bytes([len(rid)]) + rid + value


def opened(secret: bytes, scope: str, key: str, raw) -> tuple[str, bytes] | None:
    """(the round it was sealed for, the value) of an entry sealed with ``secret`` under
    ``scope`` and ``key``, whatever its round; None when it is not (forged, unsigned)."""
    raw = _bytes(raw)
    head = len(MAGIC) + TAG_BYTES
    if len(raw) < head + 1 or not raw.startswith(MAGIC):
        return None
    end = head + 1 + raw[head]
    if len(raw) < end:
        return None
    try:
        round_id = raw[head + 1:end].decode()
    except UnicodeDecodeError:
        return None
    value = raw[end:]
    if not hmac.compare_digest(raw[len(MAGIC):head], tag(secret, scope, key, value, round_id)):
        return None
    return round_id, value


def unseal(secret: bytes, scope: str, key: str, raw, round_id: str = "") -> bytes | None:
    """The value of a sealed entry, or None when its tag does not verify for ``scope``,
    ``key`` and round ``round_id``."""
    got = opened(secret, scope, key, raw)
    if got is None or got[0] != round_id:
        return None
    return got[1]


def forged(scope: str, key: str, other_round: str | None = None, round_id: str = "") -> None:
    """Say once per key that a value without a valid tag (``other_round`` None) or one
    sealed for another round (a replay) was ignored."""
    where = f"{scope}/{key}"
    if (where, other_round is None) in _warned:
        return
    _warned.add((where, other_round is None))
    from reft_ext.report.events import emit

    if other_round is None:
        emit("store_forged", f"warning: store value for {where} is not signed with the "
             f"job's secret (another client wrote it): ignored", key=where)
    else:
        emit("store_replayed", f"warning: store value for {where} is from another round "
             f"({other_round or 'none'}; this is {round_id or 'none'}: another client "
             f"replayed it): ignored", key=where, round=other_round)


class ForgedValueError(RuntimeError):
    """Only forged values were found under a key until the store's timeout."""


class SignedStore(torch.distributed.Store):
    """``inner`` with every set value sealed and every read value verified."""

    def __init__(self, inner, secret: bytes, scope: str, round_id: str = ""):
        super().__init__()
        if len(secret) < 32:
            raise ValueError("SignedStore: the job's secret must have 32 bytes or more")
        self.inner, self.secret, self.scope, self.round_id = inner, secret, scope, round_id
        _alive.append(self)

    # ---- sealed values --------------------------------------------------------------
    def set(self, key, value) -> None:
        self.inner.set(key, seal(self.secret, self.scope, key, value, self.round_id))

    def get(self, key) -> bytes:
        deadline = time.monotonic() + self._timeout_s()
        while True:
            got = opened(self.secret, self.scope, key, self.inner.get(key))
            if got is not None and got[0] == self.round_id:
                return got[1]
            forged(self.scope, key, None if got is None else got[0], self.round_id)
            if time.monotonic() > deadline:
                raise ForgedValueError(
                    f"store key {self.scope}/{key}: only values not signed with the job's "
                    f"secret for this round were there for {self._timeout_s():.0f} s "
                    f"(another client overwrote the job's own): not used")
            time.sleep(POLL_S)

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def clone(self) -> "SignedStore":
        """A store of its own over a clone of the inner one (gloo clones the store of a
        group with a timeout of its own: torch 2.13)."""
        return SignedStore(self.inner.clone(), self.secret, self.scope, self.round_id)

    # ---- plain: presence, counters, housekeeping --------------------------------------
    def add(self, key, amount) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout

    def _timeout_s(self) -> float:
        try:
            return self.inner.timeout.total_seconds()
        except AttributeError:
            return 300.0
