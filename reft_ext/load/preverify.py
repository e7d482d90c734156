"""Checksums of a survivor's own snapshot, taken while the job re-forms.

After an in-process restart, REFT-load's first round hashes what a recovery without
losses reads (reft_ext/load/inventory.py): a few hundred MB per rank, every rank at
once, on the critical path of the resume. A survivor knows which bytes those are as
soon as its generation is abandoned (the committed slots stop changing then: the
snapshot in flight is dropped, and a slot being rewritten has no manifest), while the
job still waits for the dead rank's replacement to be assigned, to rendezvous and to
build its model. So the survivor starts that round's checksums on a thread at the
abandon, and REFT-load takes each result whose slot, iteration and region record are
the ones it reads again; anything else (a newer manifest, round 2) it hashes itself.

A verdict is one of the bytes it was taken of: both ``True`` and ``False`` are reused.
Nothing writes those bytes in between: the next snapshot begins only after the
recovery.
"""

from __future__ import annotations

import threading

import torch

from reft_ext.load.inventory import SlotFormat, take_inventory
from reft_ext.store.slots import region_verified

_pending: "Preverify | None" = None
_lock = threading.Lock()


def _key(slot: int, m: dict, region) -> tuple:
    return (slot, int(m["iteration"]), str(region), tuple(m["regions"][region]),
            m.get("checksum"), m.get("nbytes"))


class Preverify:
    """Round 1's checksums of one store (``owner``: its directory and rank), on a thread."""

    def __init__(self, owner: tuple, manifests: dict[int, dict], fmt: SlotFormat,
                 data: dict[int, torch.Tensor]):
        self.owner, self.results = owner, {}
        self._data = data  # slot -> its bytes, mapped (the store hands them over)
        self.thread = threading.Thread(target=self._run, args=(manifests, fmt),
                                        name="reft-preverify", daemon=True)
        self.thread.start()

    def _run(self, manifests: dict, fmt: SlotFormat) -> None:
        try:
            take_inventory(manifests, fmt, False, self._verify)
        except Exception:  # noqa: BLE001 - a head start only: REFT-load hashes what is missing
            pass
        self._data = {}

    def _verify(self, slot: int, m: dict, region) -> bool:
        data = self._data.get(slot)
        if data is None or data.numel() < int(m["nbytes"]):
            raise KeyError(slot)  # not mapped here: REFT-load verifies it
        ok = region_verified(data, m, region)
        self.results[_key(slot, m, region)] = ok
        return ok

    def verify(self, fallback):
        """REFT-load's verify function: the verdict taken here for the same bytes,
        else ``fallback``'s (the store's own). Waits for the thread first."""
        self.thread.join()

        def verify(slot: int, m: dict, region) -> bool:
            hit = self.results.get(_key(slot, m, region))
            return fallback(slot, m, region) if hit is None else hit
        return verify


def start(owner: tuple, manifests: dict[int, dict], fmt: SlotFormat,
          data: dict[int, torch.Tensor]) -> Preverify:
    """At the abandon of a generation: begin round 1's checksums of these slots (the
    caller keeps them mapped until the returned one's ``thread`` ends)."""
    global _pending
    with _lock:
        _pending = Preverify(owner, manifests, fmt, data)
        return _pending


def discard() -> None:
    """Before the next snapshot begins: verdicts not taken by a REFT-load are dropped
    (the bytes they were taken of may change from now on)."""
    global _pending
    with _lock:
        p, _pending = _pending, None
    if p is not None:
        p.thread.join()


def take(owner: tuple) -> Preverify | None:
    """REFT-load: the checksums begun for this store (once), or None."""
    global _pending
    with _lock:
        p, _pending = _pending, None
    return p if p is not None and p.owner == owner else None
