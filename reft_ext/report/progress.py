"""Megatron-style progress lines with an ETA for the long tools (stdlib only, no torch).

Why: tokenizing a corpus, a Monte-Carlo check or a benchmark sweep runs for minutes with
nothing on screen. tqdm is not a dependency here, and a per-item redraw floods CI logs,
so one small class does both cases:

* on a terminal it redraws one line in place with ``\\r`` (at most 10 times a second):
  ``desc [#######-----] done/total  pct% | rate/s | elapsed mm:ss | ETA mm:ss``;
* anywhere else (CI, log files, pipes) it prints a plain line at most every ``every_s``
  seconds (default 10, or env ``REFT_PROGRESS_EVERY_S``) and one final line.

It is silent when ``total`` is 0 and when ``REFT_NO_PROGRESS=1``. It writes to stderr, so
what a tool prints on stdout (tables, [BENCH] lines) is unchanged; ``write()`` and
``paused()`` print without tearing a bar drawn on the same terminal.

    with Progress(os.path.getsize(path), desc="tokenize", unit="B") as bar:
        bar.update(nbytes)
    for case in progress(cases, desc="cases", unit="case"):
        ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time

BAR = 30           # characters of the bar drawn on a terminal
TTY_EVERY_S = 0.1  # terminal redraws at most this often: update() stays cheap in tight loops
_now = time.monotonic


def _env_every_s() -> float:
    try:
        return float(os.environ.get("REFT_PROGRESS_EVERY_S", "10"))
    except ValueError:
        return 10.0


def _clock(seconds: float) -> str:
    """mm:ss (h:mm:ss from an hour on)."""
    m, s = divmod(int(max(seconds, 0)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _amount(x, unit: str) -> str:
    if unit == "B":  # binary prefixes
        for u in ("B", "KiB", "MiB", "GiB"):
            if abs(x) < 1024:
                return f"{x:.0f} B" if u == "B" else f"{x:.1f} {u}"
            x /= 1024
        return f"{x:.1f} TiB"
    if isinstance(x, int):
        return str(x)
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}"


class Progress:
    """Progress of ``total`` units; ``update(n)`` adds n done. A context manager."""

    def __init__(self, total, desc: str = "", unit: str = "", stream=None,
                 every_s: float | None = None, disable: bool = False):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.stream = sys.stderr if stream is None else stream
        self.every_s = _env_every_s() if every_s is None else every_s
        self.silent = bool(disable or total == 0
                           or os.environ.get("REFT_NO_PROGRESS", "") not in ("", "0"))
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self.closed, self._width, self.t0 = False, 0, _now()
        self._next = self.t0 + (TTY_EVERY_S if self.tty else self.every_s)
        if self.tty and not self.silent:
            self._emit(final=False)  # a terminal shows the bar at once

    def update(self, n=1) -> None:
        self.n += n
        if self.silent or self.closed:
            return
        now = _now()
        if now >= self._next:
            self._next = now + (TTY_EVERY_S if self.tty else self.every_s)
            self._emit(final=False)

    def close(self) -> None:
        """Draw the final line (also after an exception: it shows where it stopped)."""
        if not self.closed:
            self.closed = True
            if not self.silent:
                self._emit(final=True)

    @contextlib.contextmanager
    def paused(self):
        """Clear a bar drawn on a terminal while the block prints, then redraw it."""
        drawn = self.tty and not self.silent and not self.closed and self._width
        if drawn:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        try:
            yield
        finally:
            if drawn:
                sys.stdout.flush()
                self._width = 0
                self._emit(final=False)

    def write(self, text: str, file=None) -> None:
        """print(text) to ``file`` (stdout by default) without tearing a terminal bar."""
        with self.paused():
            print(text, file=sys.stdout if file is None else file, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self) -> str:
        elapsed = _now() - self.t0
        rate = self.n / elapsed if elapsed > 0 else 0.0
        u = f" {self.unit}" if self.unit and self.unit != "B" else ""
        speed = (f"{1 / rate:.1f} s/{self.unit or 'it'}" if 0 < rate < 1 and self.unit != "B"
                 else f"{_amount(rate, self.unit)}{u}/s")
        tail = f"{speed} | elapsed {_clock(elapsed)}"
        head = f"{self.desc}: " if self.desc else ""
        if not self.total:  # unknown length: no bar, no ETA
            return f"{head}{_amount(self.n, self.unit)}{u} | {tail}"
        frac = min(max(self.n / self.total, 0.0), 1.0)
        eta = "done" if self.n >= self.total else \
            f"ETA {_clock((self.total - self.n) / rate) if rate > 0 else '--:--'}"
        stats = (f"{_amount(self.n, self.unit)}/{_amount(self.total, self.unit)}{u} "
                 f"{100 * frac:3.0f}% | {tail} | {eta}")
        if self.tty:
            fill = int(BAR * frac)
            return f"{self.desc} [{'#' * fill}{'-' * (BAR - fill)}] {stats}".lstrip()
        return head + stats

    def _emit(self, final: bool) -> None:
        text = self.line()
        try:
            if self.tty:
                text = text[:max(shutil.get_terminal_size((120, 24)).columns - 1, 20)]
                self.stream.write("\r" + text.ljust(self._width) + ("\n" if final else ""))
                self._width = len(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # closed stream, broken pipe: progress is not worth dying for
            self.silent = True


def progress(iterable, total=None, desc: str = "", **kwargs):
    """Yield every item of ``iterable`` unchanged, showing a :class:`Progress` over it
    (``total`` defaults to ``len(iterable)`` when it has one)."""
    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    with Progress(total, desc, **kwargs) as bar:
        for item in iterable:
            yield item
            bar.update()
