"""reft_ext/report/events.py: the [REFT] line as before, and the same fact as one JSON
object per line in $REFT_EVENTS_FILE (what the tests assert on, tests/harness/events.py)."""

import json
import os
import stat
import subprocess
import sys

from reft_ext.report import events
from reft_ext.save.snapshotter import reft_print
from reft_ext.state.regions import Source
from tests.harness.events import Events, load
from tests.harness.run import ENV_PATH, REPO


def test_line_alone_without_the_environment_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(events.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    reft_print("recovered iteration 4 on rank 2 from ARC replica", event="recovered",
               iteration=4)
    assert capsys.readouterr().out == "[REFT] recovered iteration 4 on rank 2 from ARC replica\n"
    assert os.listdir(tmp_path) == []


def test_line_and_event(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ev.jsonl"
    monkeypatch.setenv(events.ENV, str(path))
    monkeypatch.setenv("RANK", "3")
    reft_print("snapshot iteration 1: 64 bytes", event="snapshot", iteration=1,
               per_rank={"own": 32}, source=Source.REPLICA, group=(2, 3), tiers=None)
    reft_print("a line no program reads")  # no event: the line alone
    events.emit("health", None, ok=True)   # no text: the event alone
    assert capsys.readouterr().out == ("[REFT] snapshot iteration 1: 64 bytes\n"
                                       "[REFT] a line no program reads\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first, second = load(str(path))
    assert first.pop("time") > 0 and second.pop("time") > 0
    assert first == {"event": "snapshot", "rank": 3, "iteration": 1, "per_rank": {"own": 32},
                     "source": "replica", "group": [2, 3], "tiers": None}
    assert second == {"event": "health", "rank": 3, "ok": True}


def test_an_event_names_the_rank_it_is_about(tmp_path, monkeypatch):
    path = tmp_path / "ev.jsonl"
    monkeypatch.setenv(events.ENV, str(path))
    monkeypatch.delenv("RANK", raising=False)
    events.emit("hang", None, rank=5)  # a watcher (no RANK) reporting rank 5
    events.emit("flushed", None, node=1)
    assert [(e["event"], e["rank"]) for e in load(str(path))] == [("hang", 5), ("flushed", None)]


def test_processes_append_whole_lines(tmp_path):
    """Four processes, 200 events each, one file: every line a whole object."""
    path = tmp_path / "ev.jsonl"
    code = ("import sys; from reft_ext.report.events import record\n"
            "for i in range(200): record('e', i=i, pad='x' * 300)")
    env = dict(os.environ, **ENV_PATH, **{events.ENV: str(path)})
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                              env=dict(env, RANK=str(r))) for r in range(4)]
    assert [p.wait() for p in procs] == [0] * 4
    lines = path.read_text().splitlines()
    assert len(lines) == 800
    got = [json.loads(ln) for ln in lines]
    for r in range(4):
        assert [e["i"] for e in got if e["rank"] == r] == list(range(200))


def test_a_half_written_line_is_skipped_and_queries(tmp_path):
    path = tmp_path / "ev.jsonl"
    path.write_text('{"event": "recovered", "rank": 0, "source": "own"}\n'
                    '{"event": "recovered", "rank": 2, "source": "replica"}\n'
                    '{"event": "recov')
    ev = load(str(path))
    assert isinstance(ev, Events) and len(ev) == 2
    assert ev.of("recovered", source="replica") == [ev[1]]
    assert ev.one("recovered", rank=0)["source"] == "own"
    assert ev.by_rank("recovered") == {0: ev[0], 2: ev[1]}
    assert load(str(tmp_path / "missing.jsonl")) == []
