"""How long a SIGKILLed process's peers wait for its sockets to close, by what it maps.

    python benchmarks/bench_teardown.py [--gb 2.4] [--shm-gb 1.7] [--repeats 3]

Linux closes a dying process's files (its sockets: what a gloo peer sees as "Connection
closed by peer") only after it has torn down its address space, so the survivors of an
in-process restart wait for the dead rank's page tables (docs/nodes.md, "Where the lost
node's abort goes"). A child maps memory and touches every page, the parent holds the
other end of a socket pair, kills the child and times the EOF: anonymous memory in
4 KiB pages and as transparent huge pages (what THP_MEM_ALLOC_ENABLE=1 gives torch's
tensors), and /dev/shm mappings (the snapshot slots), kept or unlinked (a node loss
wipes them). Medians of --repeats, with an empty process as the baseline.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import socket
import statistics
import time

PAGE = 4096


def _touch(m, n: int) -> None:
    for i in range(0, n, PAGE):
        m[i] = 1


def _child(conn, kind: str, gb: float) -> None:
    n = int(gb * 2**30)
    keep = []
    if kind.startswith("anon"):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if kind == "anon-huge":
            m.madvise(mmap.MADV_HUGEPAGE)
        _touch(m, n)
        keep.append(m)
    elif kind.startswith("shm"):
        path = f"/dev/shm/bench-teardown-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.ftruncate(fd, n)
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
        _touch(m, n)
        keep.append(m)
        if kind == "shm-unlinked":
            os.unlink(path)
    conn.send(b"r")
    conn.recv(1)  # killed while waiting here
    time.sleep(3600)


def one(kind: str, gb: float) -> float:
    """ms from the SIGKILL to the peer's EOF."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            _child(b, kind, gb)
        finally:
            os._exit(0)
    b.close()
    a.recv(1)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    a.recv(1)
    ms = 1e3 * (time.perf_counter() - t0)
    os.waitpid(pid, 0)
    a.close()
    path = f"/dev/shm/bench-teardown-{pid}"
    if os.path.exists(path):
        os.unlink(path)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.4, help="anonymous memory (a rank's heap)")
    ap.add_argument("--shm-gb", type=float, default=1.7, help="/dev/shm mapped (its slots)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split()
    rows = [("empty process", "none", 0.0), ("anonymous, 4 KiB pages", "anon", a.gb),
            ("anonymous, huge pages (madvise)", "anon-huge", a.gb),
            ("/dev/shm mapped", "shm", a.shm_gb),
            ("/dev/shm mapped, unlinked", "shm-unlinked", a.shm_gb)]
    print(f"THP enabled: {' '.join(thp)}; medians of {a.repeats}")
    print("| memory of the killed process | GB | ms to the peer's EOF |")
    print("|---|---|---|")
    for label, kind, gb in rows:  # interleaving would not help: each is a fresh process
        ms = statistics.median(one(kind, gb) for _ in range(a.repeats))
        print(f"| {label} | {gb:g} | {ms:.0f} |")


if __name__ == "__main__":
    main()
