"""REFT-load's first checksums, begun at an in-process restart's abandon
(reft_ext/load/preverify.py): the verdicts taken early are used for exactly the bytes
they were taken of, anything else is hashed again, and the next store of the process
waits for the thread before it claims (and may resize or unmap) the mappings it reads.
Real /dev/shm segments."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reft_ext.load import preverify
from reft_ext.load.inventory import SlotFormat, take_inventory
from reft_ext.store import handover
from reft_ext.store.checksum import checksum
from reft_ext.store.slots import SnapshotStore

N = 1 << 20  # bytes per region
FMT = SlotFormat({"sig": 1}, 4 * N, "arc")


@pytest.fixture
def store(shm_store):
    yield shm_store
    preverify.discard()  # its thread reads the store's mappings: done before they close


def _write(store, iteration: int, fill: int) -> tuple[int, dict]:
    """One whole slot: four regions of ``fill``-derived bytes and their checksums."""
    slot, data = store.begin(4 * N)
    data.copy_((torch.arange(4 * N) * fill % 251).to(torch.uint8))
    regions = {r: [i * N, N, checksum(data[i * N:(i + 1) * N], "xxh3_64/4M")]
               for i, r in enumerate(("own", "redundancy", "owned", "aor"))}
    m = {"iteration": iteration, "nbytes": 4 * N, "layout": FMT.signature,
         "protection": "arc", "checksum": "xxh3_64/4M", "regions": regions,
         "aor": {"valid": True, "owner": 1}}
    store.finish(slot, m)
    store.commit(slot, iteration)
    return slot, m


def _owner(store):
    return (store.dir, store.rank)


def _counting(store):
    calls = []

    def verify(slot, m, region):
        calls.append((slot, str(region)))
        return store.verify(slot, m, region)
    return verify, calls


def test_round_one_uses_the_early_verdicts_and_hashes_only_the_rest(store):
    slot, m = _write(store, 7, 3)
    store.data(slot, 4 * N)[2 * N + 5] ^= 0xFF  # the owned region: corrupt before the abandon
    early = preverify.start(_owner(store), store.manifests(), FMT, store.mapped(4 * N))
    assert preverify.take(("elsewhere", 0)) is None  # another store's: not taken
    early = preverify.start(_owner(store), store.manifests(), FMT, store.mapped(4 * N))
    taken = preverify.take(_owner(store))
    assert taken is early and preverify.take(_owner(store)) is None  # once
    fallback, calls = _counting(store)
    held = take_inventory(store.manifests(), FMT, False, taken.verify(fallback))
    assert calls == []  # round 1: every verdict was taken early
    flags = held[7].ok
    assert flags["own"] is True and flags["redundancy"] is True and flags["owned"] is False
    # round 2 reads the AOR region too: not begun early, so hashed now
    take_inventory(store.manifests(), FMT, True, taken.verify(fallback))
    assert calls == [(slot, "aor")]


def test_a_slot_written_since_is_hashed_again(store):
    _write(store, 7, 3)
    early = preverify.start(_owner(store), store.manifests(), FMT, store.mapped(4 * N))
    early.thread.join()
    slot, _ = _write(store, 8, 5)  # the other slot, newer: its records differ
    fallback, calls = _counting(store)
    held = take_inventory(store.manifests(), FMT, False, preverify.take(_owner(store))
                          .verify(fallback))
    assert held[8].ok["own"] is True
    assert sorted(calls) == [(slot, "own"), (slot, "owned"), (slot, "redundancy")]


def test_discard_drops_verdicts_no_load_took(store):
    _write(store, 7, 3)
    preverify.start(_owner(store), store.manifests(), FMT, store.mapped(4 * N))
    preverify.discard()
    assert preverify.take(_owner(store)) is None


def test_the_next_store_waits_for_the_reader_before_claiming(store):
    store.reserve(4 * N)
    release = threading.Event()
    reader = threading.Thread(target=release.wait, daemon=True)
    reader.start()
    store.hand_over(reader=reader)
    done = []
    new = SnapshotStore(store.job.rsplit("/node", 1)[0], 0, 0, "/dev/shm", slots=2)
    t = threading.Thread(target=lambda: done.append(new.reserve(4 * N)), daemon=True)
    t.start()
    time.sleep(0.3)
    assert not done  # the claim waits for the thread still reading the mappings
    release.set()
    t.join(10)
    assert done and handover.held() == 0
    new.close()
