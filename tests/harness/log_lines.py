"""What a person reads in a run's log, checked on its output: megatron-core's fallback
warnings as one line (megatron/training/fallbacks.py) and REFT's snapshot lines, one per
--log-interval or, with --reft-log-every-snapshot, one per snapshot
(reft_ext/report/snapshot_log.py)."""

from __future__ import annotations

import re

FALLBACK = "megatron-core: Transformer Engine and Apex are not installed, so it uses "
# the raw warnings it replaces (megatron-core 0.16), and its own default's deprecation
RAW = ("Apex is not installed. Falling back", "Transformer Engine and Apex are not installed. "
       "Falling back", "full scope is deprecated")
INTERVAL = re.compile(r"\[REFT\] snapshots of iterations? (\d+)(?:-(\d+))?: (\d+) x \d+ bytes "
                      r".*(?:; |, of it )training blocked [\d.]+ ms median, [\d.]+ ms max; copy [\d.]+ ms "
                      r"median, [\d.]+ ms max \(median: rank 0, max: (slowest rank|rank 0)\)")
EACH = re.compile(r"\[REFT\] snapshot iteration (\d+): \d+ bytes on \d+ ranks .*; training "
                  r"blocked [\d.]+ ms, copy [\d.]+ ms \((slowest rank|rank 0)\), committed")


def assert_one_fallback_line(output: str) -> None:
    """One line from rank 0 on a machine without TE and Apex, none of the raw warnings
    (a run with PYTHONWARNINGS unset: the harness ignores them by default)."""
    assert output.count(FALLBACK) == 1, output[:3000]
    assert not [w for w in RAW if w in output], output[:3000]
    assert output.index(FALLBACK) < output.index("---- arguments ----")  # the first screen


def assert_interval_lines(output: str, windows: list[tuple[int, int]]) -> None:
    """Exactly one [REFT] snapshots line per window (first, last iteration), one snapshot
    per iteration, each with the slowest rank's maxima; no per-snapshot lines."""
    found = [(int(m[1]), int(m[2] or m[1]), int(m[3]), m[4]) for m in INTERVAL.finditer(output)]
    assert found == [(a, b, b - a + 1, "slowest rank") for a, b in windows], \
        [line for line in output.splitlines() if "[REFT] snapshot" in line]
    assert not EACH.search(output)


def every_snapshot_lines(output: str) -> list[int]:
    """The iterations of the [REFT] snapshot iteration lines, in order."""
    return [int(m[1]) for m in EACH.finditer(output)]
