"""reft_ext.report.progress: terminal redraws, bounded plain lines for logs, the off switches, and
that the Monte-Carlo checks give the same numbers with and without progress (pure python)."""

import io

import numpy as np
import pytest

import reft_ext.report.progress as prog
from reft_ext.plan.reliability import simulate_goodput, simulate_unrecoverable
from reft_ext.report.progress import Progress, progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("REFT_NO_PROGRESS", raising=False)
    monkeypatch.delenv("REFT_PROGRESS_EVERY_S", raising=False)


@pytest.fixture
def clock(monkeypatch):
    """A clock that advances `step` seconds at every reading."""
    state = {"t": 1000.0, "step": 1.0}

    def now():
        state["t"] += state["step"]
        return state["t"]

    monkeypatch.setattr(prog, "_now", now)
    return state


def test_plain_lines_are_bounded_and_end_with_the_total(clock):
    out = io.StringIO()
    with Progress(100, "docs", unit="doc", stream=out, every_s=10) as bar:
        for _ in range(100):  # 100 s of fake time: a line every 10 s at most
            bar.update()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 2 <= len(lines) <= 12, lines
    assert lines[0].startswith("docs: ") and "ETA " in lines[0]
    assert "100/100 doc 100%" in lines[-1] and lines[-1].endswith("done"), lines[-1]


def test_plain_fast_loop_prints_one_final_line():
    out = io.StringIO()
    for _ in progress(range(10000), desc="fast", stream=out):  # real clock, < 10 s
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "10000/10000 100%" in lines[0], lines


def test_tty_redraws_one_line_with_percent_and_eta(clock):
    out = FakeTTY()
    clock["step"] = 0.5
    with Progress(10 * 2**20, "tokenize", unit="B", stream=out) as bar:
        for _ in range(10):
            bar.update(2**20)
    text = out.getvalue()
    assert text.count("\r") >= 5 and text.count("\n") == 1 and text.endswith("\n")
    frames = text.split("\r")
    mid = next(f for f in frames if " 50% " in f)
    assert "[###############---------------]" in mid and "5.0 MiB/10.0 MiB" in mid
    assert "iB/s | elapsed 00:0" in mid and "ETA 00:0" in mid
    assert "100%" in frames[-1] and "done" in frames[-1]


def test_write_clears_the_tty_bar_and_prints_unchanged(clock, capsys):
    out = FakeTTY()
    with Progress(3, "runs", stream=out) as bar:
        bar.write("a table row")
        bar.update()
    assert capsys.readouterr().out == "a table row\n"
    assert "\r" + " " * len(out.getvalue().split("\r")[1]) + "\r" in out.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO, FakeTTY])
def test_silent_when_disabled_by_env_or_empty(stream, monkeypatch, clock):
    for total, env in ((0, None), (5, "1")):
        if env:
            monkeypatch.setenv("REFT_NO_PROGRESS", env)
        out = stream()
        with Progress(total, "x", stream=out, every_s=0) as bar:
            for _ in range(5):
                bar.update()
        assert list(progress(range(total), desc="y", stream=out, every_s=0)) == \
            list(range(total))
        assert out.getvalue() == "", (total, env)


def test_iterable_helper_yields_every_item_unchanged():
    items = [object(), None, 0, "", [1], (2, 3)]
    out = io.StringIO()
    assert list(progress(items, desc="items", stream=out)) == items
    assert "6/6" in out.getvalue()
    gen = (i * i for i in range(7))  # no len(): no bar, no ETA, but counted
    out = io.StringIO()
    assert list(progress(gen, desc="gen", unit="sq", stream=out)) == [i * i for i in range(7)]
    assert out.getvalue().startswith("gen: 7 sq |")


def test_clock_format():
    assert prog._clock(65) == "01:05" and prog._clock(3725) == "1:02:05"
    assert prog._amount(1536, "B") == "1.5 KiB" and prog._amount(7, "") == "7"


def test_monte_carlo_identical_with_and_without_progress(monkeypatch, capsys):
    args = (0.5, 0.2, 0.1, 0.004, 0.2, 2.0, 0.1, 0.5, 2000.0)
    on = simulate_goodput(*args, np.random.default_rng(3))
    u_on = simulate_unrecoverable(8, 1, 0.01, 1.0, 10.0, 6000.0, 2, np.random.default_rng(4))
    err = capsys.readouterr().err
    assert "monte-carlo goodput: 2000/2000 h 100%" in err and "2/2 group" in err
    off = simulate_goodput(*args, np.random.default_rng(3), show_progress=False)
    u_off = simulate_unrecoverable(8, 1, 0.01, 1.0, 10.0, 6000.0, 2, np.random.default_rng(4),
                                   show_progress=False)
    monkeypatch.setenv("REFT_NO_PROGRESS", "1")
    env_off = simulate_goodput(*args, np.random.default_rng(3))
    assert capsys.readouterr().err == ""
    assert on == off == env_off and u_on == u_off
