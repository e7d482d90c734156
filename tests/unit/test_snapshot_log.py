"""The log a person reads (issue 36), without torchrun: REFT's snapshot lines follow
--log-interval (reft_ext/report/snapshot_log.py), --reft-log-every-snapshot brings back
one line per snapshot, and megatron-core's fallback warnings are muted by their wording
only (megatron/training/fallbacks.py)."""

import argparse
import importlib.util
import sys
import types
import warnings

from megatron.training import fallbacks
from reft_ext.config import ReftConfig
from reft_ext.report import events
from reft_ext.report.snapshot_log import SnapshotLog
from tests.harness.events import load
from tests.harness.log_lines import EACH, INTERVAL

WHAT = dict(bytes=4096, ranks=2, per_rank={"own": 1024, "redundancy": 1024, "owned": 0,
                                           "aor": 0}, protection="arc")
TIERS = {"bubble": 512, "compute": 256, "drain": 256}


def _run(log: SnapshotLog, iterations, stop: bool = True) -> None:
    """What ReftSnapshotter._finish does per committed snapshot (the job-wide maxima:
    rank 0's own here, as if gathered), and the session at the end of training."""
    for it in iterations:
        if log.stale(it):
            log.interval(WHAT, "has", None)
        log.add(it, it / 1000, 2 * it / 1000, 10.0, dict(TIERS))
        closes = log.closes_window(it)
        log.snapshot(it, WHAT, "has", dict(TIERS), it / 1000, 2 * it / 1000, 10.0, closes)
        if closes:
            log.interval(WHAT, "has", (log.max_blocked_s, log.max_copy_s))
    if stop:
        log.interval(WHAT, "has", None)


def test_one_line_per_log_interval_with_its_figures(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(events.ENV, str(tmp_path / "ev.jsonl"))
    _run(SnapshotLog(interval=4, every=1, every_snapshot=False, rank0=True), range(1, 11))
    out = capsys.readouterr().out.splitlines()
    # iterations 1-4 and 5-8 close at their last snapshot; 9-10: the end of training
    assert [INTERVAL.match(line).group(1, 2, 3, 4) for line in out] == [
        ("1", "4", "4", "slowest rank"), ("5", "8", "4", "slowest rank"),
        ("9", "10", "2", "rank 0")]
    assert out[0] == (
        "[REFT] snapshots of iterations 1-4: 4 x 4096 bytes on 2 ranks (per rank: own "
        "1024, arc 1024, owned 0), has, rank 0's 4 copies: 2048 B in bubbles, 1024 B beside "
        "compute, 1024 B at the step; training blocked 2.5 ms median, 4.0 ms max; copy 5.0 ms "
        "median, 8.0 ms max (median: rank 0, max: slowest rank); committed 10.0 ms after the "
        "step (median)")
    ev = load(str(tmp_path / "ev.jsonl"))
    assert [e["iteration"] for e in ev.of("snapshot")] == list(range(1, 11))  # every one
    first = ev.of("snapshot_interval")[0]
    assert (first["first"], first["last"], first["snapshots"], first["blocked_ms"]) == \
        (1, 4, 4, {"median": 2.5, "max": 4.0})


def test_every_snapshot_flag_prints_each_and_no_interval_line(capsys):
    parser = argparse.ArgumentParser()
    ReftConfig.add_arguments(parser)  # the trainer's REFT flags, generated from the fields
    cfg = ReftConfig.from_args(parser.parse_args(["--reft-log-every-snapshot"]))
    assert cfg.log_every_snapshot and not ReftConfig().log_every_snapshot
    _run(SnapshotLog(4, 1, cfg.log_every_snapshot, rank0=True), range(1, 7))
    out = capsys.readouterr().out.splitlines()
    assert [EACH.match(line).group(1, 2) for line in out] == [
        ("1", "rank 0"), ("2", "rank 0"), ("3", "rank 0"), ("4", "slowest rank"),
        ("5", "rank 0"), ("6", "rank 0")]


def test_windows_with_sparse_snapshots_a_rollback_and_other_ranks(capsys):
    # --reft-snapshot-every 3, --log-interval 10: 3, 6, 9 close at 9 (no snapshot at 10)
    log = SnapshotLog(10, 3, False, rank0=True)
    assert [i for i in range(3, 31, 3) if log.closes_window(i)] == [9, 18, 30]
    _run(log, [3, 6, 9, 12, 15, 9, 12, 15, 18], stop=False)  # rolled back from 15 to 9
    found = [INTERVAL.match(line).group(1, 2, 3) for line in capsys.readouterr().out.splitlines()]
    # 12, 15 left before their window closed: printed when 9 came back, then 9 alone
    assert found == [("3", "9", "3"), ("12", "15", "2"), ("9", None, "1"), ("12", "18", "3")]
    quiet = SnapshotLog(4, 1, False, rank0=False)  # not rank 0: maxima kept, nothing said
    _run(quiet, range(1, 4), stop=False)
    assert quiet.max_copy_s == 0.006 and capsys.readouterr().out == ""


def test_fallback_warnings_muted_by_their_wording_only():
    fallbacks.install()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fallbacks.install()  # (after simplefilter: in front of it, as at start-up)
        for message in ("Apex is not installed. Falling back to Torch Norm",
                        "Transformer Engine and Apex are not installed. Falling back to "
                        "Torch optimizers.", "another warning"):
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module="megatron.core.x")
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm",
                               UserWarning, "y.py", 1, module="some_other_package")
    assert [(str(w.message), w.filename) for w in seen] == [
        ("another warning", "x.py"), ("Apex is not installed. Falling back to Torch Norm",
                                      "y.py")]


def test_fallback_line_says_what_megatron_core_chose(monkeypatch):
    """From megatron-core's own module flags (stand-ins here: importing the real modules
    takes seconds; test_reft_collectives.py checks the line of a real run)."""
    local = object()
    flags = {"megatron.core.optimizer": dict(USING_PYTORCH_OPTIMIZER=True),
             "megatron.core.optimizer.clip_grads": dict(multi_tensor_applier=local),
             "megatron.core.utils": dict(local_multi_tensor_applier=local),
             "megatron.core.models.backends": dict(HAVE_APEX=False)}
    for name, values in flags.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**values))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # neither here
    assert fallbacks.summary() == (
        "megatron-core: Transformer Engine and Apex are not installed, so it uses "
        "torch.optim's AdamW/SGD, its local multi-tensor kernels and torch's norms instead "
        "of their fused ones")
    # TE there, Apex not: only the norms fell back
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "apex"
                        else object())
    sys.modules["megatron.core.optimizer"].USING_PYTORCH_OPTIMIZER = False
    sys.modules["megatron.core.optimizer.clip_grads"].multi_tensor_applier = object()
    assert fallbacks.summary() == ("megatron-core: Apex is not installed, so it uses torch's "
                                   "norms instead of their fused ones")
    sys.modules["megatron.core.models.backends"].HAVE_APEX = True
    assert fallbacks.summary() is None


def test_the_interval_line_gives_the_hooks_wall_time_beside_the_copy_wait(capsys):
    """issue 57: the cost per iteration is the hooks' wall time (goodput's snapshot),
    not the copy wait alone."""
    log = SnapshotLog(interval=2, every=1, every_snapshot=False, rank0=True)
    for it, hook in ((1, 0.006), (2, 0.008)):
        log.hooks_s.append(hook)
        log.add(it, 0.0001, 0.002, 5.0, dict(TIERS))
    log.interval(WHAT, "has", None)
    out = capsys.readouterr().out
    assert "; REFT's work 7.0 ms per iteration (rank 0's median: its hooks less their " \
           "wait for the slowest rank in the commit, what goodput books as snapshot), of " \
           "it training blocked 0.1 ms median" in out
