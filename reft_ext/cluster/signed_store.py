"""A torch.distributed Store whose values carry an HMAC under the job's secret.

torch's TCPStore has no login: any process that reaches its port can write any key. The
process groups of a job rendezvous through such a store (gloo: each rank's peer address
under ``<prefix>/<rank>``; NCCL: the unique id), and the agents of torchrun publish the
workers' ``MASTER_ADDR``/``MASTER_PORT`` in one. A forged value there points a rank at an
address of the writer's choosing, and what a "peer" sends through
``all_gather_object`` is unpickled. :class:`SignedStore` wraps such a store: every value
it sets is ``MAGIC + HMAC-SHA256(secret, scope, key, value) + value``, and ``get`` returns
only values whose tag verifies. A value without a valid tag is ignored (one warning per
key): ``get`` looks again until the job's own value is there (one written before the
job's, which the job's ``set`` then replaces) or the store's timeout passes (one written
after it: the job's value is gone, the wait fails; the forged address is never used).

``scope`` names what the values belong to (the store prefix, with the generation or the
rendezvous round), so a value cannot be replayed under another key or in another round.
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

MAGIC = b"RS1\0"
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

_warned: set[str] = set()
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


def tag(secret: bytes, scope: str, key: str, value: bytes) -> bytes:
    msg = b"\0".join((scope.encode(), key.encode(), value))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def seal(secret: bytes, scope: str, key: str, value) -> bytes:
    """``value`` as stored under ``key`` in ``scope``: magic, tag, value."""
    value = _bytes(value)
    return MAGIC + tag(secret, scope, key, value) + value


def unseal(secret: bytes, scope: str, key: str, raw) -> bytes | None:
    """The value of a sealed entry, or None when its tag does not verify."""
    raw = _bytes(raw)
    head = len(MAGIC) + TAG_BYTES
    if len(raw) < head or not raw.startswith(MAGIC):
        return None
    value = raw[head:]
    if not hmac.compare_digest(raw[len(MAGIC):head], tag(secret, scope, key, value)):
        return None
    return value


def forged(scope: str, key: str) -> None:
    """Say once per key that a value without a valid tag was ignored."""
    where = f"{scope}/{key}"
    if where in _warned:
        return
    _warned.add(where)
    from reft_ext.report.events import emit

    emit("store_forged", f"warning: store value for {where} is not signed with the job's "
         f"secret (another client wrote it): ignored", key=where)


class ForgedValueError(RuntimeError):
    """Only forged values were found under a key until the store's timeout."""


class SignedStore(torch.distributed.Store):
    """``inner`` with every set value sealed and every read value verified."""

    def __init__(self, inner, secret: bytes, scope: str):
        super().__init__()
        if len(secret) < 32:
            raise ValueError("SignedStore: the job's secret must have 32 bytes or more")
        self.inner, self.secret, self.scope = inner, secret, scope
        _alive.append(self)

    # ---- sealed values --------------------------------------------------------------
    def set(self, key, value) -> None:
        self.inner.set(key, seal(self.secret, self.scope, key, value))

    def get(self, key) -> bytes:
        deadline = time.monotonic() + self._timeout_s()
        while True:
            value = unseal(self.secret, self.scope, key, self.inner.get(key))
            if value is not None:
                return value
            forged(self.scope, key)
            if time.monotonic() > deadline:
                raise ForgedValueError(
                    f"store key {self.scope}/{key}: only values not signed with the job's "
                    f"secret were there for {self._timeout_s():.0f} s (another client "
                    f"overwrote the job's own): not used")
            time.sleep(POLL_S)

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def clone(self) -> "SignedStore":
        """A store of its own over a clone of the inner one (gloo clones the store of a
        group with a timeout of its own: torch 2.13)."""
        return SignedStore(self.inner.clone(), self.secret, self.scope)

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
