"""``--inject-fault RANK:ITER[:SIGNAL[:MODE[:ATTEMPT]]][@PHASE]``: the grammar, its errors,
which phases a run can reach (reft_ext/testing/fault_specs.py), and the one fault observer
(reft_ext/testing/fault_observer.py) behind reft_ext.testing.fault_point: which specs
fire, once."""

from __future__ import annotations

import errno
import os
import signal
from types import SimpleNamespace

import pytest

from reft_ext.testing import fault_observer as fo
from reft_ext.testing import fault_point, get_fault_observer, set_fault_observer
from reft_ext.testing import fault_specs as fs
from reft_ext.testing.fault_specs import FaultSpecError


@pytest.fixture(autouse=True)
def no_observer(monkeypatch):
    """Every test starts and ends without an observer, on attempt 0."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("REFT_NODE_GENERATION", raising=False)
    set_fault_observer(None)
    yield
    set_fault_observer(None)


@pytest.fixture
def kills(monkeypatch):
    """The signals the observer sends (recorded, not sent) and its [FAULT] lines."""
    sent, lines = [], []
    monkeypatch.setattr(fo.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(fo.time, "sleep", lambda s: None)
    monkeypatch.setattr(fo, "emit", lambda msg, *a, **k: lines.append(msg))
    return SimpleNamespace(sent=sent, lines=lines)


# ---- grammar ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("1:3", fs.FaultSpec(1, 3)),
    ("1:3:TERM", fs.FaultSpec(1, 3, signal.SIGTERM)),
    ("1:3:SIGSTOP", fs.FaultSpec(1, 3, signal.SIGSTOP)),
    ("1:3:9", fs.FaultSpec(1, 3, signal.SIGKILL)),
    ("2:5:KILL:node:1", fs.FaultSpec(2, 5, signal.SIGKILL, "node", 1)),
    ("1:5::corrupt-manifest", fs.FaultSpec(1, 5, signal.SIGKILL, "corrupt-manifest")),
    ("1:3@backward", fs.FaultSpec(1, 3, phase="backward")),
    ("0:4:STOP::1@send", fs.FaultSpec(0, 4, signal.SIGSTOP, "", 1, "send")),
    ("3:2:KILL:node@commit", fs.FaultSpec(3, 2, signal.SIGKILL, "node", phase="commit")),
    ("1:6:CONT:shm-full", fs.FaultSpec(1, 6, signal.SIGCONT, "shm-full")),
    ("0:0:::1@health", fs.FaultSpec(0, 0, attempt=1, phase="health")),
    ("1:3@step", fs.FaultSpec(1, 3)),
])
def test_grammar(text, want):
    got = fs.parse_fault_spec(text, world_size=4)
    assert got == want
    assert fs.parse_fault_spec(fs.format_fault_spec(got)) == got  # round trip
    assert str(got) == fs.format_fault_spec(got)


def test_mode_snapshot_is_phase_snapshot_write():
    old = fs.parse_fault_spec("2:5:KILL:snapshot")
    assert old == fs.parse_fault_spec("2:5@snapshot-write") == \
        fs.parse_fault_spec("2:5::snapshot@snapshot-write")
    assert (old.phase, old.mode) == ("snapshot-write", "")


def test_several_specs_and_every_phase_parses():
    specs = fs.parse_fault_specs(",".join(f"1:3@{p}" for p in fs.PHASES) + ",", 2)
    assert [s.phase for s in specs] == list(fs.PHASES)
    assert set(fs.TRAINER_PHASES) | set(fs.LIBRARY_PHASES) == set(fs.PHASES)
    assert fs.DEFAULT_PHASE == "step" and "step" in fs.TRAINER_PHASES


@pytest.mark.parametrize("text,match", [
    ("1:3@", "empty phase after '@'.*phases: forward, backward"),
    ("1:3@nope", "unknown phase 'nope' in '1:3@nope'; phases: forward, backward, send, recv, "
                 "step, save"),
    ("1:3@Backward", "unknown phase 'Backward'"),
    ("1:3::snapshot@forward", "mode snapshot is the phase snapshot-write, not 'forward'"),
    ("1", "expected RANK:ITER\\[:SIGNAL\\[:MODE\\[:ATTEMPT\\]\\]\\]\\[@PHASE\\]"),
    ("1:2:3:4:5:6", "expected RANK:ITER"),
    ("1:x", "RANK and ITER must be integers"),
    ("1:3:SIGNOPE", "unknown signal 'SIGNOPE'"),
    ("1:3:KILL:sometimes", "unknown mode 'sometimes'.*shm-full"),
    ("1:3:KILL:node:x", "ATTEMPT must be an integer"),
    ("7:3", "rank 7 is outside the world of 4 ranks"),
    ("1:0", "iteration must be >= 1 \\(0 only with @health/@join/@data/@on-start\\), got 0"),
    ("1:-1@health", "RANK and ITER must be integers|iteration must be >= 0"),
])
def test_errors_name_the_flag(text, match):
    with pytest.raises(FaultSpecError, match=match) as exc:
        fs.parse_fault_spec(text, world_size=4)
    assert str(exc.value).startswith("--inject-fault: ")


def _args(**kw):
    """Flags as validate_args sees them (the health check's at their defaults)."""
    from reft_ext.cluster.health_config import HealthConfig

    health = {f"reft_{k}": v for k, v in vars(HealthConfig()).items() if k != "injection"}
    base = dict(health, pipeline_model_parallel_size=2, save="/ckpt", async_save=False,
                reft_snapshot_every=1, reft_schedule="has", reft_protect="arc,aor")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("phase,args,match", [
    ("send", _args(pipeline_model_parallel_size=1), "phase send needs pipeline parallelism"),
    ("recv", _args(pipeline_model_parallel_size=1), "phase recv needs pipeline"),
    ("save", _args(save=None), "phase save needs --save"),
    ("save-tracker", _args(save=None), "phase save-tracker needs --save"),
    ("save-async", _args(), "phase save-async needs --async-save"),
    ("commit", _args(reft_snapshot_every=0), "phase commit needs REFT snapshots"),
    ("load-read", _args(reft_snapshot_every=0), "phase load-read needs REFT snapshots"),
    ("flush", _args(), "phase flush is the node watcher's.*REFT_WATCHER_FAULT"),
    ("has-copy", _args(reft_schedule="end-of-iteration"),
     "phase has-copy needs a background snapshot copy"),
    ("aor", _args(reft_protect="arc"), r"phase aor needs AOR \(--reft-protect"),
])
def test_unreachable_phases_are_refused(phase, args, match):
    with pytest.raises(FaultSpecError, match=f"^--inject-fault: 1:3:SIGKILL::0@{phase}: {match}"):
        fs.check_fault_phases([fs.parse_fault_spec(f"1:3@{phase}")], args)


def test_reachable_phases_pass():
    specs = fs.parse_fault_specs(",".join(f"1:3@{p}" for p in fs.PHASES if p != "flush"))
    fs.check_fault_phases(specs, _args(async_save=True))
    fs.check_fault_phases(fs.parse_fault_specs("1:3@forward,1:3@backward,1:3"),
                          _args(pipeline_model_parallel_size=1, save=None,
                                reft_snapshot_every=0))


def test_health_phase_needs_the_health_check():
    off = _args(reft_snapshot_every=0)
    with pytest.raises(FaultSpecError, match="phase health needs the start-up health check"):
        fs.check_fault_phases([fs.parse_fault_spec("0:0@health")], off)
    fs.check_fault_phases([fs.parse_fault_spec("0:0@health")],
                          SimpleNamespace(**{**vars(off), "reft_snapshot_every": 1}))


# ---- the observer -----------------------------------------------------------------------
def test_the_trainer_installs_from_its_flags():
    """megatron/training/fault_injection.py, the trainer's one seam: parse the flag, put
    the observer behind fault_point on a rank it names."""
    from megatron.training import fault_injection

    assert fault_injection.install_from_args(SimpleNamespace(inject_fault=None), 1) == []
    assert fault_injection.install_from_args(SimpleNamespace(inject_fault="0:3"), 1) == \
        [fs.FaultSpec(0, 3)]
    assert get_fault_observer() is None  # not this rank's
    specs = fault_injection.install_from_args(SimpleNamespace(inject_fault="1:3@forward"), 1)
    assert specs == [fs.FaultSpec(1, 3, phase="forward")]
    assert fo.observer() is get_fault_observer() and fo.wants("forward")


def test_no_observer_without_a_fault_of_this_rank():
    assert fo.install(fs.parse_fault_specs("1:3,2:4@forward"), rank=0) is None
    assert get_fault_observer() is None and fo.observer() is None
    assert not fo.wants("forward")
    fault_point("forward", iteration=4)  # no observer: nothing at all


def test_fires_matching_specs_once(kills):
    obs = fo.install(fs.parse_fault_specs("1:3:CONT@backward,1:3:TERM@forward,0:3@backward,"
                                          "1:4:CONT@backward,1:3:CONT::1@backward"), rank=1)
    assert fo.observer() is obs and get_fault_observer() is obs
    assert fo.wants("backward") and fo.wants("forward") and not fo.wants("send")
    fault_point("backward", iteration=2)
    fault_point("send", iteration=3)
    assert kills.sent == []
    fault_point("backward", iteration=3)
    assert kills.sent == [signal.SIGCONT]
    assert kills.lines[-1].startswith("[FAULT] injecting SIGCONT into rank 1 (pid ")
    assert kills.lines[-1].endswith(") at iteration 3, phase backward")
    fault_point("backward", iteration=3)  # once per process (a rollback redoes ITER)
    fault_point("forward", iteration=3)
    fault_point("backward", iteration=4)
    assert kills.sent == [signal.SIGCONT, signal.SIGTERM, signal.SIGCONT]
    assert fo.wants("backward", att=1) and not fo.wants("backward")


def test_attempt_picks_the_restart(kills, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fo.install(fs.parse_fault_specs("0:5:CONT,0:5:TERM::1"), rank=0)
    fault_point("step", iteration=5)
    assert kills.sent == [signal.SIGTERM]
    monkeypatch.setenv("REFT_NODE_GENERATION", "1")  # a replacement node: attempt 2
    fo.install(fs.parse_fault_specs("0:5:TERM::1"), rank=0)
    fault_point("step", iteration=5)
    assert kills.sent == [signal.SIGTERM]
    # the health check passes the job-wide attempt
    fo.install(fs.parse_fault_specs("0:0:CONT::3@health"), rank=0)
    fault_point("health", iteration=0)
    fault_point("health", iteration=0, attempt=3)
    assert kills.sent == [signal.SIGTERM, signal.SIGCONT]
    assert kills.lines[-1].endswith("at iteration 0, phase health")


def test_snapshot_mode_and_maybe_inject_fault(kills):
    specs = fs.parse_fault_specs("1:5:KILL:snapshot,1:6")
    fo.maybe_inject_fault(specs, 1, 5)  # installs on first use; the step moment
    assert kills.sent == []
    fault_point("snapshot-write", iteration=5)
    assert kills.sent == [signal.SIGKILL]
    assert kills.lines[-1].endswith("at iteration 5, phase snapshot-write (during its "
                                    "snapshot write)")
    fo.maybe_inject_fault(specs, 1, 6)
    assert kills.sent == [signal.SIGKILL] * 2
    assert kills.lines[-1].endswith("at iteration 6, phase step")


def test_reft_damage_is_delegated(kills):
    obs = fo.install(fs.parse_fault_specs("2:5:KILL:node,2:6:CONT:corrupt-replica@aor"), 2)
    calls = []
    fault_point("step", iteration=5)  # REFT off: no delegate, the kill alone
    assert kills.sent == [signal.SIGKILL] and kills.lines[-1].endswith(" (node loss)")
    obs.reft = lambda point, **info: calls.append((point, info))
    fault_point("aor", iteration=6)
    assert calls == [("corrupt", {"iteration": 6, "mode": "corrupt-replica"})]
    fault_point("node-loss")
    assert calls[-1] == ("node-loss", {"iteration": None})
    fault_point("some-future-point", iteration=1)  # ignored


def test_shm_full_fails_the_next_reservation(kills, tmp_path):
    from reft_ext.store.shm import ShmSegment, ShmSpaceError

    obs = fo.install(fs.parse_fault_specs("0:4:KILL:shm-full"), rank=0)
    seg = ShmSegment.create("t", "a.bin", 4096, base_dir=str(tmp_path))  # not armed yet
    fault_point("step", iteration=4)
    assert kills.sent == []  # no signal: the full tmpfs is the fault
    assert obs.shm_full and "its next space reservation fails with ENOSPC" in \
        kills.lines[-1]
    with pytest.raises(ShmSpaceError) as exc:
        seg.resize(8192)
    assert exc.value.errno == errno.ENOSPC and "needs 4096 more bytes" in str(exc.value)
    assert seg.nbytes == 4096  # untouched, still usable
    seg.resize(8192)  # the next one succeeds again
    with pytest.raises(OSError):  # an explicit fault point raises as well
        obs.shm_full = True
        fault_point("shm-reserve", path="x", length=1)
    seg.close()


def test_phase_timers_reach_the_fault_points(kills):
    from megatron.training.pipeline_events import PhaseTimers, fault_phases

    assert fault_phases("forward-compute") == ("forward",)
    assert fault_phases("backward-compute") == ("backward",)
    assert fault_phases("forward-recv") == ("recv",)
    assert fault_phases("backward-send") == ("send",)
    assert fault_phases("backward-send-forward-recv") == ("send", "recv")
    assert fault_phases("forward-backward") == ()
    fo.install(fs.parse_fault_specs("0:2:CONT@recv,0:2:TERM@backward"), rank=0)
    timers = PhaseTimers(None)  # the seam alone, no events
    timers("backward-compute").start()  # evaluation / before the trainer set one: nothing
    timers.iteration = 1
    timers("forward-send-backward-recv").start()
    assert kills.sent == []
    timers.iteration = 2
    timers("forward-compute").start()
    timers("forward-compute").stop()
    timers("forward-send-backward-recv").start()
    assert kills.sent == [signal.SIGCONT]
    assert kills.lines[-1].endswith("at iteration 2, phase recv")
    timers("backward-compute").start()
    assert kills.sent == [signal.SIGCONT, signal.SIGTERM]


# ---- a really full tmpfs (root only: a tiny tmpfs mounted for the test) ------------------
@pytest.fixture
def full_tmpfs(tmp_path):
    """A 16 KiB tmpfs filled to the last page; skipped where mounting is not allowed."""
    import subprocess

    d = tmp_path / "tiny"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(d / "filler", "wb") as f:
            try:
                f.write(b"\0" * 65536)
                f.flush()
            except OSError:
                pass
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_heartbeat_on_a_full_tmpfs_is_an_error_not_sigbus(full_tmpfs):
    """Regression: the heartbeat file was ftruncate'd (a hole) and mmap'd; on a full
    tmpfs its first beat wrote into an unallocatable page: SIGBUS, the rank gone without
    a word. Its page is allocated up front now: ENOSPC, an ordinary error."""
    import subprocess
    import sys

    code = ("from reft_ext.cluster.heartbeat import Heartbeat\n"
            f"Heartbeat({full_tmpfs!r}, 0)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != -signal.SIGBUS, "SIGBUS on a full tmpfs"
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr[-2000:]


def test_background_reservation_fails_at_the_first_use(kills, tmp_path):
    """SnapshotStore.reserve(background=True) (a replacement's or a fresh start's slots):
    the segments are made by a thread, each usable as soon as it exists; an ENOSPC in
    that thread is raised, as the same ShmSpaceError, by the first use of the segment it
    could not make (never a SIGBUS later), and what it made is kept open."""
    import stat

    from reft_ext.store.shm import ShmSpaceError
    from reft_ext.store.slots import SnapshotStore

    store = SnapshotStore("bg", 0, 0, str(tmp_path))
    store.reserve(8192, buffers={"aor": 4096}, background=True)
    slot, data = store.begin(8192)
    assert data.numel() == 8192 and store.buffer("aor", 4096).numel() == 4096
    files = sorted(os.listdir(store.dir))
    assert files == ["rank0.aor.bin", "rank0.slot0.bin", "rank0.slot1.bin"], files
    assert all(stat.S_IMODE(os.stat(os.path.join(store.dir, f)).st_mode) == 0o600
               for f in files)
    store.close()

    obs = fo.install(fs.parse_fault_specs("1:4:KILL:shm-full"), rank=1)
    fault_point("step", iteration=4)  # armed: the next reservation fails
    assert obs.shm_full
    full = SnapshotStore("bg", 0, 1, str(tmp_path))
    full.reserve(8192, buffers={"aor": 4096}, background=True)  # the check passes
    with pytest.raises(ShmSpaceError) as exc:  # the aor buffer was the one it failed on
        full.buffer("aor", 4096)
    assert exc.value.errno == errno.ENOSPC and "rank1.aor.bin" in str(exc.value)
    slot, data = full.begin(8192)  # not made by the thread: made now, fault spent
    assert data.numel() == 8192
    full.close()
    assert not full._segs and not full._made

