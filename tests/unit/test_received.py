"""Bytes received from a peer during REFT-load are checked against the checksum their
writer recorded (reft_ext/load/received.py), and the ``corrupt-send`` fault that damages
them in transit (reft_ext/testing/fault_observer.py). End to end, with real ranks:
tests/integration/test_reft_recovery.py (``*_in_transit_*``, ``*parity_block_flipped*``)."""

from __future__ import annotations

import signal

import pytest
import torch

from reft_ext.load.inventory import Held
from reft_ext.load.received import Received, outgoing
from reft_ext.state.regions import Region
from reft_ext.store.checksum import checksum
from reft_ext.testing import set_fault_observer
from reft_ext.testing import fault_observer as fo
from reft_ext.testing import fault_specs as fs
from reft_ext.testing.fault_specs import FaultSpecError

ALGO = "xxh3_64/4M"


# every test starts and ends without an observer, on attempt 0 (the same autouse fixture)
from tests.unit.test_fault_specs import no_observer  # noqa: E402,F401


def _payload(n=4096):
    return (torch.arange(n) * 7 % 251).to(torch.uint8)


def _rx(buf, region=Region.REDUNDANCY):
    """Rank 1 holds ``buf`` in ``region`` of iteration 4; rank 0 holds nothing (a lost
    node: no checksum to check against)."""
    held = Held(3, {region: True}, None, {region: checksum(buf, ALGO)}, ALGO)
    return Received(2, 4, [{}, {4: held}, {}])


def test_intact_bytes_pass_and_a_flipped_byte_is_named():
    buf = _payload()
    rx = _rx(buf)
    assert rx.check(buf.clone(), "slice 1 (rank 1's)", 1, 1, Region.REDUNDANCY)
    assert rx.problems == [] and rx.checked == buf.numel()
    bad = buf.clone()
    bad[100] ^= 0x01  # one bit
    assert not rx.check(bad, "slice 1 (rank 1's)", 1, 1, Region.REDUNDANCY)
    assert len(rx.problems) == 1
    assert rx.problems[0].startswith(f"slice 1 (rank 1's) received from rank 1 does not "
                                     f"match its {ALGO} checksum (")


def test_another_owners_checksum_and_a_missing_one():
    buf = _payload()
    rx = _rx(buf, Region.OWN)
    bad = buf.clone()
    bad[-1] ^= 0x80
    assert not rx.check(bad, "slice 1 rebuilt from parity", 3, 1, Region.OWN)
    assert "received from rank 3 does not match rank 1's" in rx.problems[0]
    # an owner whose memory is gone (rank 0) recorded nothing here: nothing to check
    assert rx.check(bad, "slice 0 rebuilt from parity", 3, 0, Region.OWN)
    # a region the owner does not hold in that iteration (or another iteration)
    assert rx.check(bad, "x", 1, 1, Region.AOR)
    assert Received(2, 5, rx.inventories).check(bad, "x", 1, 1, Region.OWN)


def test_corrupt_send_flips_a_copy_never_the_snapshot():
    spec = fs.parse_fault_spec("0:4:CONT:corrupt-send:1@load-read", world_size=2)
    assert spec == fs.FaultSpec(0, 4, signal.SIGCONT, "corrupt-send", 1, "load-read")
    lines = []
    obs = fo.FaultObserver([spec], 0)
    set_fault_observer(obs)
    orig = fo.emit
    fo.emit = lines.append
    try:
        snap = _payload()
        assert outgoing(snap, 4, "slice 0", 1) is snap  # not armed yet
        obs.fire(spec)  # no signal: only armed
        sent = outgoing(snap, 4, "slice 0", 1)
    finally:
        fo.emit = orig
    assert sent is not snap and torch.equal(snap, _payload())  # the snapshot intact
    assert int((sent != snap).sum()) == 1
    assert lines[-1].startswith("[FAULT] flipped a byte of slice 0 rank 0 sends to rank 1 "
                                "while restoring iteration 4")


def test_corrupt_send_must_be_armed_before_the_exchange():
    with pytest.raises(FaultSpecError, match="corrupt-send arms the next REFT-load send: "
                                             "use @load-read"):
        fs.parse_fault_spec("0:4:CONT:corrupt-send", world_size=2)
