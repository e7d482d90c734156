"""Loss-spike rollback pieces without processes: the detector's rule and bound, its
flags, and the snapshot ring (--reft-keep) that rollback reaches back into."""

import math
import uuid

import pytest
import torch

from reft_ext.config import ReftConfig, ReftConfigError
from reft_ext.load.rollback import (RollbackConfig, RollbackLimitError, SpikeDetector,
                                    batches_to_skip)
from reft_ext.store.slots import SnapshotStore


def _feed(det, losses, start=1, gnorm=1.0):
    for i, loss in enumerate(losses, start):
        assert det.observe(i, loss, gnorm) is None, (i, loss)


def test_spike_rule_fires_on_outliers_not_on_a_falling_loss():
    det = SpikeDetector(RollbackConfig(rollback_on="spike", spike_window=20))
    falling = [6.0 - 0.1 * i + 0.01 * (-1) ** i for i in range(15)]  # a normal descent
    _feed(det, falling)
    assert det.observe(16, 4.45, 1.0) is None  # below the median: never a spike
    why = det.observe(17, 9.0, 1.0)
    assert why.startswith("loss spike: 9 > median") and "over the last 16 iterations" in why
    why = det.observe(17, 4.4, 50.0)
    assert why.startswith("grad norm spike: 50 > median 1")  # a flat history has a floor
    assert det.observe(17, 4.4, 1.25) is None  # +25% on a flat history: not a spike
    assert det.observe(17, 4.4, 1.31) is not None  # past the floor: 6 x 5% of the median


def test_nan_mode_ignores_spikes_and_catches_non_finite_values():
    det = SpikeDetector(RollbackConfig(rollback_on="nan"))
    _feed(det, [5.0] * 10)
    assert det.observe(11, 50.0, 1e6) is None
    assert det.observe(12, math.nan, 1.0) == "non-finite loss (nan)"
    assert det.observe(12, 4.0, math.inf) == "non-finite grad norm (inf)"
    assert SpikeDetector(RollbackConfig(rollback_on="off")).observe(1, math.nan, 1.0) is None


def test_spike_rule_waits_for_enough_history():
    det = SpikeDetector(RollbackConfig(rollback_on="spike"))
    _feed(det, [5.0] * 7)
    assert det.observe(8, 500.0, 1.0) is None  # 7 values: not judged yet
    assert det.observe(9, 500.0, 1.0) is not None


def test_rollback_bound_stops_a_loop_and_history_after_the_target_is_forgotten():
    det = SpikeDetector(RollbackConfig(rollback_on="nan", rollback_limit=2, spike_window=10))
    _feed(det, [5.0] * 9)
    assert det.rolled_back(9, 7) == 1
    assert [h[0] for h in det.history] == list(range(1, 8))
    assert det.rolled_back(12, 10) == 2
    with pytest.raises(RollbackLimitError, match="--reft-rollback-limit: 3 rollbacks within "
                                                 "10 iterations"):
        det.rolled_back(15, 13)
    det2 = SpikeDetector(RollbackConfig(rollback_on="nan", rollback_limit=1, spike_window=5))
    det2.rolled_back(3, 1)
    assert det2.rolled_back(20, 18) == 1  # the first fell out of the window


@pytest.mark.parametrize("kw,flag", [
    (dict(rollback_on="sometimes"), "--reft-rollback-on"),
    (dict(spike_threshold=0), "--reft-spike-threshold"),
    (dict(spike_window=1), "--reft-spike-window"),
    (dict(rollback_limit=0), "--reft-rollback-limit"),
    (dict(skip_batches=-1), "--reft-skip-batches"),
    (dict(skip_batches=0), "--reft-skip-batches: must be >= 1 .a rollback always skips")])
def test_bad_rollback_flags_name_the_flag(kw, flag):
    with pytest.raises(ReftConfigError, match=flag):
        RollbackConfig(**kw)


def test_skip_goes_through_the_spiking_batch_whatever_the_ring_depth():
    """Issue 29's case: 16 samples a batch, iteration i reads samples 16(i-1)..16i-1; a
    NaN at 12 rolls back to 10 (a ring of 2): iterations 11 and 12's batches are skipped,
    12's (176-191) included, not 11's alone."""
    s = batches_to_skip(10, 12, restored_samples=160, spike_samples=192,
                        global_batch_size=16, skip_batches=1)
    assert (s.first, s.last, s.batches, s.after_spike) == (160, 191, 2, 0)
    assert s.text() == ("skipped 2 global batch(es) (iterations 11-12's, through the "
                        "spiking one): samples 160-191")
    # a deeper ring (back to 8): 9..12, still through 12; a snapshot one behind: 12 alone
    assert batches_to_skip(8, 12, 128, 192, 16, 1).batches == 4
    one = batches_to_skip(11, 12, 176, 192, 16, 1)
    assert (one.first, one.last) == (176, 191)
    assert one.text() == "skipped 1 global batch(es) (iteration 12's): samples 176-191"
    # --reft-skip-batches 5 from iteration 10's position: 2 batches through the spike, 3 after
    far = batches_to_skip(10, 12, 160, 192, 16, 5)
    assert (far.first, far.last, far.batches, far.after_spike) == (160, 239, 5, 3)
    assert far.text().endswith("through the spiking one, and 3 after it): samples 160-239")
    # a skip before the spike (--skip-train-batches, an earlier rollback's) is inside
    # the range too: the data position is one counter
    assert batches_to_skip(10, 12, 160, 224, 16, 1).last == 223


def test_keep_below_two_is_rejected():
    with pytest.raises(ReftConfigError, match="--reft-keep: must be >= 2"):
        ReftConfig(snapshot_every=1, keep=1)


def _snap(store, it, n=64):
    slot, buf = store.begin(n)
    buf.fill_(it)
    store.finish(slot, {"iteration": it, "nbytes": n, "regions": {}})
    store.commit(slot, it)
    return slot


def test_ring_keeps_the_last_k_and_a_rollback_drops_the_newer(tmp_path):
    store = SnapshotStore(f"t{uuid.uuid4().hex[:8]}", 0, 0, str(tmp_path), slots=3)
    store.reserve(64)
    slots = [_snap(store, it) for it in range(1, 6)]
    assert slots == [0, 1, 2, 0, 1]  # a ring: the oldest slot is written next
    its = sorted(int(m["iteration"]) for m in store.manifests().values())
    assert its == [3, 4, 5]
    # a torn write (manifest gone) never touches the committed slot
    slot, _ = store.begin(64)
    assert slot == 2 and store.committed()["slot"] == 1
    store.finish(slot, {"iteration": 6, "nbytes": 64, "regions": {}})
    store.commit(slot, 6)
    store.discard_newer(4)  # rollback to 4: 5 and 6 are from inside the spike
    assert {int(m["iteration"]) for m in store.manifests().values()} == {4}
    assert store.committed() == {"slot": 0, "iteration": 4}
    assert torch.all(store.data(0, 64) == 4)
    # the next two snapshots reuse the dropped slots; 4 survives until the ring is full
    assert _snap(store, 5) in (1, 2) and _snap(store, 6) in (1, 2)
    assert {int(m["iteration"]) for m in store.manifests().values()} == {4, 5, 6}
    assert _snap(store, 7) == 0
    store.remove()
