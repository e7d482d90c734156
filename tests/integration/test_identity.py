"""Run identity: a run never resumes another run's snapshots (same --reft-job-id, another
seed or protection), from host memory or from a flush directory; the same run does."""

import os
import re
import shutil
import uuid

import pytest

from tests.harness.run import LAYOUTS, TINY, torchrun

from reft_ext.state.identity import differences, fingerprint, mismatch
from reft_ext.store.slots import sealed

N = ["--train-iters", "3"]


def _reft(job, *extra):
    return ["--reft-snapshot-every", "1", "--reft-protect", "arc", "--reft-ranks-per-node",
            "1", "--reft-job-id", job, *extra]


@pytest.mark.slow  # 4 job runs; test_untrusted_state's identity checks stay in the default tier
def test_another_run_with_the_same_job_id_is_refused_and_the_same_run_resumes():
    job = f"ident-{uuid.uuid4().hex[:8]}"
    base = TINY + LAYOUTS["pp2dp2"]
    try:
        first = torchrun(4, base + N + _reft(job, "--reft-keep-snapshots")).check()
        assert first.events_of("snapshot", iteration=3)
        other = torchrun(4, base + ["--train-iters", "5", "--seed", "7"] + _reft(job))
        assert other.returncode != 0
        assert ("error: --reft-job-id: host memory (/dev/shm/reft-" + job) in other.output
        run_id = re.search(r"run ([0-9a-f]{12}) \(first started", first.output).group(1)
        assert (f"holds snapshots of another run (run {run_id}, iteration 3: seed 1234 there, "
                f"7 here). Start this run with another --reft-job-id") in other.output
        assert "iteration        1/" not in other.output  # refused before any work
        changed = torchrun(4, base + ["--train-iters", "5"] + _reft(job) +
                           ["--reft-protect", "aec"])  # the later flag wins
        assert "reft_protect 'arc' there, 'aec' here" in changed.output
        same = torchrun(4, base + ["--train-iters", "5"] + _reft(job)).check()
        assert same.events_of("recovered", iteration=3, rank=0, source="own")
        assert f"run {run_id} (first started" in same.output  # the same run, carried on
    finally:
        for d in os.listdir("/dev/shm"):
            if d.startswith(f"reft-{job}"):
                shutil.rmtree(os.path.join("/dev/shm", d), ignore_errors=True)


def test_mismatch_names_the_fields_and_a_manifest_without_identity_is_refused(tmp_path):
    mine = {"seed": 1, "num_layers": 4, "data_path": None}
    theirs = dict(mine, seed=2)
    assert fingerprint(mine) == fingerprint(dict(reversed(list(mine.items()))))
    assert differences(mine, theirs) == ["seed 2 there, 1 here"]
    ok = {"iteration": 5, "identity": {"fingerprint": fingerprint(mine), "fields": mine}}
    bad = {"iteration": 4, "identity": {"fingerprint": fingerprint(theirs), "fields": theirs}}
    bare = {"iteration": 3}  # every REFT manifest carries one: torn or foreign
    assert mismatch({"a.json": ok}, mine) is None
    assert mismatch({"a.json": ok, "b.json": bare}, mine) == \
        "b.json carries no run identity: torn, or not written by REFT"
    assert mismatch({"a.json": ok, "b.json": bad}, mine) == "iteration 4: seed 2 there, 1 here"
    # a flushed manifest is read the same way (reft_ext/load/flushed.py files)
    (tmp_path / "rank0.slot0.json").write_text(sealed(dict(bad, nbytes=1)))
    (tmp_path / "rank0.slot0.bin").write_bytes(b"x")
    from reft_ext.load.flushed import flushed_manifests

    assert mismatch(flushed_manifests(str(tmp_path), 0), mine).startswith(
        "iteration 4")
