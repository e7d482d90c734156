"""A long run keeps a fixed memory: the per-iteration timings of the end-of-run summary
are bounded windows, and a thread that outlives its bounded join is reported, not
silently left running."""

import statistics
import threading
import tracemalloc

from reft_ext.report import events, summary
from reft_ext.save.has import Batch, HasWorker, Unit
from reft_ext.report.timeline import Trace
from reft_ext.state.regions import Region


def test_window_keeps_the_last_values_and_a_fixed_memory():
    w = summary.Window(size=100)
    for i in range(1000):
        w.append(float(i))
    assert len(w) == 100 and w.count == 1000
    assert list(w) == [float(i) for i in range(900, 1000)]
    assert statistics.median(w) == 949.5  # the median of the window, not of the run
    # memory: 100000 more values leave nothing behind (a list would keep ~3 MB)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(100_000):
        w.append(i * 0.5)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert len(w) == 100 and w.count == 101_000


def _line(blocked, iters):
    return summary.format_summary(extra={}, every=1, regions={"own": 2**20},
                                  blocked_s=blocked, iteration_s=iters, nodes=1,
                                  host_bytes_per_node=2**20, protection="arc")


def test_summary_says_what_its_medians_cover():
    blocked, iters = summary.Window(size=4), summary.Window(size=4)
    for v in (0.001, 0.002, 0.003):  # fewer than the window: the whole run, as before
        blocked.append(v)
        iters.append(100 * v)
    line = _line(blocked, iters)
    assert "training blocked on the copy 2.00 ms per snapshot (median)" in line
    for v in (0.010, 0.010, 0.010):  # 6 values, the window the last 4: 0.003, 0.010 x 3
        blocked.append(v)
        iters.append(100 * v)
    line = _line(blocked, iters)
    assert "training blocked on the copy 10.00 ms per snapshot (median of the last 4 " \
           "snapshots)" in line


def test_a_thread_that_outlives_its_join_is_reported(tmp_path, monkeypatch, capsys):
    """The HAS snapshot thread stuck in a unit (a copy that never ends) when it is closed:
    close() says so (a [REFT] warning line, a thread_alive event) and returns False."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.ENV, str(path))
    started, release = threading.Event(), threading.Event()

    def stuck() -> int:
        started.set()
        release.wait(30)
        return 0

    worker = HasWorker(Trace(0, False))
    worker.submit(Batch([Unit(Region.OWN, 0, 8, stuck)], iteration=7))
    assert started.wait(10)
    try:
        assert worker.close(timeout_s=0.05) is False
    finally:
        release.set()
    out = capsys.readouterr().out
    assert "[REFT] warning: the HAS snapshot thread (thread reft-has) still running 0.05 s " \
           "after it was told to stop; going on without it" in out
    (ev,) = [e for e in events.read(str(path)) if e["event"] == "thread_alive"]
    assert ev["thread"] == "reft-has" and ev["timeout_s"] == 0.05
    # a thread that does stop in time: no warning
    worker2 = HasWorker(Trace(0, False))
    assert worker2.close(timeout_s=10) is True
    worker._thread.join(10)  # released: the stuck one ends too
    assert not worker._thread.is_alive()
    assert "warning" not in capsys.readouterr().out
