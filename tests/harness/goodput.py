"""What a run's goodput accounting must satisfy (reft_ext/report/goodput.py): each rank's
newest ``goodput`` record holds the job's totals; its categories add up to its wall time,
which is the time from the rank's first process start (its first ``startup`` event,
written by another code path) to that record, across every restart."""

from __future__ import annotations

from reft_ext.report.goodput import CATEGORIES, FAILURE


def assert_goodput_adds_up(run, ranks: int, failures: int, attempts: int | None = None):
    """Every rank's categories sum to its wall time (1e-6) and the wall time is the one
    the run's own events give (1%); the failures and process attempts are the job's; the
    failures' categories were booked; the end-of-run line says so."""
    finals = run.events.by_rank("goodput", final=True)
    assert sorted(finals) == list(range(ranks)), (sorted(finals), run.output[-3000:])
    for rank, rec in finals.items():
        sec = rec["seconds"]
        assert set(sec) == set(CATEGORIES), sec
        assert all(v >= 0 for v in sec.values()), sec
        assert abs(sum(sec.values()) - rec["wall"]) <= 1e-6 * rec["wall"], rec
        starts = [e["process_start"] for e in run.events_of("startup", rank=rank)]
        assert starts, run.events.names()
        wall = rec["time"] - min(starts)
        assert abs(wall - rec["wall"]) <= 0.01 * wall, (rank, wall, rec)
        assert sec["productive"] > 0 and sec["startup"] > 0, sec
    job = max(r["failures"] for r in finals.values())
    assert job == failures, [r["failures"] for r in finals.values()]
    if attempts is not None:
        assert max(r["attempts"] for r in finals.values()) == attempts, finals
    if failures:  # some rank rejoined and restored (detection may be booked as kept
        # iterations: a restore newer than the last record moves the gap to productive)
        for cat in ("rejoin", "restore"):
            assert any(r["seconds"][cat] > 0 for r in finals.values()), (cat, finals)
        assert all(sum(r["seconds"][c] for c in FAILURE) > 0 for r in finals.values())
    line = [ln for ln in run.output.splitlines() if "[REFT] goodput: " in ln]
    assert len(line) == 1 and "categories sum to" in line[0], line
    assert f"{failures} failure" in line[0], line[0]
