"""reft_ext/report/events.py: the [REFT] line as before, and the same fact as one JSON
object per line in $REFT_EVENTS_FILE (what the tests assert on, tests/harness/events.py)."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

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
    # a field named path goes into the event, not to another file
    events.record("trace", path=str(tmp_path / "trace.json"))
    events.emit("health", None, ok=True)   # no text: the event alone
    assert capsys.readouterr().out == ("[REFT] snapshot iteration 1: 64 bytes\n"
                                       "[REFT] a line no program reads\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first, trace, second = load(str(path))
    assert first.pop("time") > 0 and second.pop("time") > 0
    assert first == {"event": "snapshot", "rank": 3, "iteration": 1, "per_rank": {"own": 32},
                     "source": "replica", "group": [2, 3], "tiers": None}
    assert trace["path"] == str(tmp_path / "trace.json")
    assert not (tmp_path / "trace.json").exists()
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


# ---- issue 60 item 3: an events file another user made or controls -----------------
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
needs_setpriv = pytest.mark.skipif(
    not (os.geteuid() == 0 and SETPRIV and os.access("/usr/bin/python3", os.X_OK)),
    reason="acting as user nobody needs root, setpriv (util-linux) and /usr/bin/python3")


@needs_setpriv
def test_an_events_file_another_user_made_is_neither_written_nor_read(capsys, monkeypatch):
    """User nobody pre-creates the events file (0666) in sticky /tmp and fills it with
    forged goodput records, and plants a link to a file of ours: no event of the job goes
    into either, no forged record is carried; one line says why (never fatal)."""
    from reft_ext.report import goodput

    d = tempfile.mkdtemp(prefix="reft-ev-", dir="/tmp")
    os.chmod(d, 0o1777)  # a shared scratch directory (sticky, like /tmp)
    theirs, link = os.path.join(d, "events.jsonl"), os.path.join(d, "link.jsonl")
    ours = os.path.join(d, "ours.txt")
    forged = json.dumps({"event": "goodput", "rank": 0, "run": "r", "pid": 1, "time": 9e9,
                         "seconds": {"productive": 1.0}, "failures": 4243, "attempts": 1000,
                         "wall": 1.0, "start": 0.0})
    try:
        subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                        "--clear-groups", "/usr/bin/python3", "-c",
                        f"import os; fd = os.open({theirs!r}, os.O_WRONLY | os.O_CREAT, "
                        f"0o666); os.fchmod(fd, 0o666); os.write(fd, {forged!r}.encode() "
                        f"+ b'\\n'); os.symlink({ours!r}, {link!r})"],
                       check=True, timeout=30)
        assert os.stat(theirs).st_uid == NOBODY  # the attack was really made
        with open(ours, "w") as f:
            f.write("mine\n")
        before = open(theirs).read()
        for path in (theirs, link):
            monkeypatch.setenv(events.ENV, path)
            assert events.record("snapshot", iteration=1) is None
            assert goodput.previous(path, "r", 0, pid=2) is None
        out = capsys.readouterr().out
        assert f"events file {theirs}: " in out and "belongs to uid 65534" in out
        assert f"events file {link}: " in out
        assert open(theirs).read() == before and open(ours).read() == "mine\n"
        with pytest.raises(PermissionError):
            events.read(theirs)
    finally:
        shutil.rmtree(d, ignore_errors=True)
