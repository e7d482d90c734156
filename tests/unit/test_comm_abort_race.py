"""The abort's socket shutdown while connections close under it. gloo's own threads drop
a dead peer's connection and an old generation's backends are destroyed on a thread, so
an fd listed a moment ago may be gone (or reused) when the abort reaches it. Seen in the
lost-node benchmark: the abort watcher died with EBADF in shutdown_peer_sockets (the
restart went on only because the training thread failed by itself)."""

from __future__ import annotations

import socket
import threading
import time

from reft_ext.cluster.comm_abort import peer_sockets, shutdown_peer_sockets


def _pairs(n: int):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(n)
    out = []
    for _ in range(n):
        c = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
        out += [c, a]
    srv.close()
    return out


def test_shutdown_survives_connections_closing_concurrently():
    errors, shut = [], []
    for _ in range(10):
        socks = _pairs(100)
        go = threading.Event()

        def close_all():  # one at a time, handing the GIL over between closes
            go.wait()
            for s in socks[::2]:
                s.close()
                time.sleep(0)

        t = threading.Thread(target=close_all)
        t.start()
        go.set()
        try:
            shut.append(shutdown_peer_sockets(set()))
            peer_sockets(set())
        except OSError as exc:  # the bug: EBADF from an fd closed after the listing
            errors.append(exc)
        t.join()
        for s in socks:
            s.close()
    assert errors == []
    assert max(shut) > 0  # it did shut the connections still open


def test_shutdown_spares_the_excluded_port_and_wakes_the_others():
    keep, other = _pairs(1), _pairs(1)
    # the "store" connection: both of its ends excluded by their peer's port
    n = shutdown_peer_sockets({keep[0].getpeername()[1], keep[1].getpeername()[1]})
    assert n >= 2  # the other pair, both ends
    keep[0].sendall(b"x")
    assert keep[1].recv(1) == b"x"  # the excluded connection still works
    other[0].settimeout(2)
    assert other[0].recv(1) == b""  # shut: reads end at once
    for s in keep + other:
        s.close()
