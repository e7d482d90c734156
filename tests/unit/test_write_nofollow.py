"""Files the project writes by name are never written through a planted link (issue 48,
item 4), and a job under plain torchrun says once what its stores expose (item 1)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from reft_ext.cluster import rendezvous
from reft_ext.report import events
from reft_ext.report.files import open_nofollow, replace_with
from reft_ext.report.timeline import write_chrome_trace


@pytest.fixture
def planted(tmp_path):
    """A file another user would want overwritten, and a link to it where a job writes."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return victim, tmp_path / "out"


def test_open_nofollow_refuses_a_link_and_writes_a_file(planted):
    victim, out = planted
    os.symlink(victim, out)
    for mode in ("w", "a", "wb"):
        with pytest.raises(OSError) as e:
            open_nofollow(str(out), mode)
        assert e.value.errno == errno.ELOOP
    assert victim.read_text() == "precious\n"
    os.unlink(out)
    with open_nofollow(str(out)) as f:
        f.write("x")
    with open_nofollow(str(out), "a") as f:
        f.write("y")
    assert out.read_text() == "xy" and (out.stat().st_mode & 0o777) == 0o600
    with pytest.raises(ValueError):
        open_nofollow(str(out), "r")


def test_events_file_that_is_a_link_is_not_written_through(planted, monkeypatch):
    victim, out = planted
    os.symlink(victim, out)
    monkeypatch.setenv(events.ENV, str(out))
    assert events.record("x", a=1) is None  # the event is lost, not the victim's file
    assert victim.read_text() == "precious\n"
    os.unlink(out)
    # a refused file stays refused for the process (said once): a fresh start writes it
    events._refused.clear()
    assert events.record("x", a=1)["a"] == 1 and json.loads(out.read_text())["a"] == 1


def test_a_trace_replaces_a_planted_link_instead_of_writing_through_it(planted):
    victim, out = planted
    os.symlink(victim, out)
    write_chrome_trace(str(out), [[{"name": "x", "ph": "X", "ts": 0, "dur": 1}]])
    assert victim.read_text() == "precious\n"
    assert not out.is_symlink() and json.loads(out.read_text())["traceEvents"][0]["name"] == "x"
    replace_with(str(out), "plain")
    assert out.read_text() == "plain" and not list(out.parent.glob("*.tmp"))


def test_plain_torchrun_is_said_once_and_the_reft_launchers_are_not(monkeypatch):
    for k in ("TORCHELASTIC_RUN_ID", "REFT_RDZV_BACKEND", "REFT_INPROCESS_STORE"):
        monkeypatch.delenv(k, raising=False)
    assert rendezvous.launch_warning() is None  # plain python: no store at all
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    said = rendezvous.launch_warning()
    assert said and "localhost:29500" in said and "reft_ext.cluster.torchrun" in said
    assert "\n" not in said
    monkeypatch.setenv("REFT_RDZV_BACKEND", rendezvous.BACKEND)  # our agent set it
    assert rendezvous.launch_warning() is None
    monkeypatch.delenv("REFT_RDZV_BACKEND")
    monkeypatch.setenv("REFT_INPROCESS_STORE", "127.0.0.1:1")  # the in-process supervisor
    assert rendezvous.launch_warning() is None
