"""What a failure seen by a rank of an in-process restart is: a peer's (this rank restarts
in its own process) or its own (it exits; the supervisor replaces it).

Classified by what the exception is, wherever it was wrapped: the whole chain of
``__cause__``/``__context__`` is read (megatron-core wraps the failed barrier of its
dataset build in ``Exception("MockGPTDataset failed to build ...") from``, a checkpoint
load its reads), types first (torch's DistError family, the sockets' ConnectionError,
:class:`PeerFailure`); gloo raises a plain RuntimeError, told only by its text. Torch-only.
"""

from __future__ import annotations

import torch

# what gloo (a plain RuntimeError naming its transport) and a socket raise when a peer
# died or our own abort closed its connections: read only off RuntimeError/OSError,
# after the types (is_peer_error)
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "Connection refused", "Socket Timeout", "Timed out", "timed out",
               "Connection timed out", "Bad file descriptor", "NCCL communicator was aborted",
               "recvBytes", "sendBytes", "ECONNRESET", "EPIPE", "/gloo/transport/")
MAX_CHAIN = 64  # causes walked at most (a cycle is cut by identity anyway)


class RestartError(RuntimeError):
    """This rank cannot restart in its own process (it exits; a replacement takes over)."""


class PeerFailure(RuntimeError):
    """Another rank of this generation failed or cannot go on, learnt from an agreement
    rather than from a failed collective (the rejoin's: megatron/training/training.py):
    this rank restarts in its own process."""


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what led to it, outermost first: each ``__cause__`` (``raise ... from``)
    and ``__context__`` (raised while handling), and the members of an exception group;
    each once."""
    out, seen, todo = [], set(), [exc]
    while todo and len(out) < MAX_CHAIN:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo.extend(getattr(e, "exceptions", ()) if isinstance(e, BaseExceptionGroup) else ())
        todo.extend((e.__cause__, e.__context__))
    return out


def _peer_type(e: BaseException) -> bool:
    """torch's DistError family (DistBackendError: NCCL; DistStoreError and
    DistNetworkError: the store a generation rendezvous on), a socket's own errors, and
    this module's PeerFailure."""
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, (PeerFailure, ConnectionError)) or \
        bool(dist_error) and isinstance(e, dist_error)


def is_peer_error(exc: BaseException) -> bool:
    """Does ``exc`` come from a peer's failure (or our own abort of the connections),
    wherever it was wrapped? The whole chain is read (megatron-core wraps a failed
    barrier of its dataset build in ``Exception(... failed to build ...)``, a checkpoint
    load wraps its reads): types first; gloo raises a plain RuntimeError, told by its
    text (:data:`PEER_ERRORS`), read only off RuntimeError and OSError. A
    :class:`RestartError` met on the way is this rank's own verdict: never a peer's."""
    for e in causes(exc):
        if isinstance(e, RestartError):
            return False
        if _peer_type(e):
            return True
        if isinstance(e, (RuntimeError, OSError)):
            text = str(e)
            if any(p in text for p in PEER_ERRORS):
                return True
    return False
