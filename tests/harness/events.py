"""The machine-readable side of REFT's log: the events a run appended to its
``$REFT_EVENTS_FILE`` (reft_ext/report/events.py), one JSON object per line. Tests assert
on their fields, not on the wording of the ``[REFT]`` lines beside them."""

from __future__ import annotations

from reft_ext.report.events import ENV, read

__all__ = ["ENV", "Events", "load"]


class Events(list):
    """Every event of one run (all ranks, all torchrun attempts, the watchers), in the
    order written."""

    def of(self, event: str, **match) -> list[dict]:
        """The events named ``event`` whose fields equal ``match`` (``rank=2``, ...)."""
        return [e for e in self if e["event"] == event and
                all(e.get(k) == v for k, v in match.items())]

    def one(self, event: str, **match) -> dict:
        """The one such event (an AssertionError naming what was there otherwise)."""
        found = self.of(event, **match)
        assert len(found) == 1, (event, match, found or self.names())
        return found[0]

    def by_rank(self, event: str, **match) -> dict:
        """rank -> that rank's last such event."""
        return {e["rank"]: e for e in self.of(event, **match)}

    def names(self) -> list[str]:
        return [e["event"] for e in self]


def load(path: str) -> Events:
    return Events(read(path))
