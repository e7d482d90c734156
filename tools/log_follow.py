"""The job's log on the terminal for tools/launch_nodes.py ``--restart in-process`` (``make
run-inprocess``): every rank's worker writes its own file under ``--log-dir``; a thread
follows them and prints each new complete line prefixed with its rank as torchrun prefixes
its workers' output (``[default3]:``), so the terminal shows what ``make run`` shows (the
argument table, Megatron's iteration lines, the ``[REFT]`` lines). A worker that takes a
rank (a warm spare, a replacement) is followed from the start of its file.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, Dict, List, TextIO


class LogFollower:
    """start(), stop() (prints what is left); ``logs()`` gives {rank: [log paths]}."""

    def __init__(self, logs: Callable[[], Dict[int, List[str]]], out: TextIO | None = None,
                 every: float = 0.2):
        self.logs, self.out, self.every = logs, out or sys.stdout, every
        self._offsets: Dict[str, int] = {}
        self._partial: Dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-follow", daemon=True)

    def start(self) -> "LogFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Print the new complete lines of every file (at the end, a last partial one)."""
        owner: Dict[str, int] = {}
        for rank, paths in sorted(dict(self.logs()).items()):
            for path in list(paths):
                owner[path] = rank  # a worker's file: the rank it holds now
        lines = []
        for path, rank in owner.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:  # not created yet
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            *done, rest = data.split(b"\n")
            if rest and final:
                done.append(rest)
            elif rest:
                self._partial[path] = rest
            lines += [f"[default{rank}]:{line.decode(errors='replace')}\n" for line in done]
        if lines:
            self.out.write("".join(lines))
            self.out.flush()
