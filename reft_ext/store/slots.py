"""Snapshot store of one rank inside its failure domain's shared memory.

A ring of K slots per rank (``--reft-keep K``, 2 or 3 by the job's size), each a data segment plus a
JSON manifest:

    /dev/shm/reft-<job>/node<n>/rank<r>.slot<s>.bin    own slice | redundancy | owned
    /dev/shm/reft-<job>/node<n>/rank<r>.slot<s>.json   iteration, layout, CRCs, metadata
    /dev/shm/reft-<job>/node<n>/rank<r>.committed      the slot of the last commit

A new snapshot always goes to an empty slot or the oldest one, never the committed one,
and its manifest is deleted before the first byte is written and renamed into place
only after the last (dirty-then-atomic-rename, as NVRx's local checkpoints do). So a crash mid-snapshot
leaves the committed slot untouched and the torn slot without a manifest. Every region
carries the checksum its owner computed from the source bytes; :meth:`verify` checks it.

The manifest holds what REFT-load restores besides the bytes (RNG states, counters,
scheduler) and the regions' checksums, and the commit pointer decides which iterations
are candidates: each file carries the SHA-256 of its own content (``self_sha256``, over
the canonical JSON of the rest). A file that fails it, or does not parse, is reported once
in a ``[REFT]`` line naming it: a manifest is then treated as torn (its slot unusable on
this rank, so the peers' redundancy rebuilds it or the job falls back), a commit pointer
as absent (the other ranks' commits decide). A file without the field is judged the
same way: every writer seals, so it is torn or not REFT's.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import os
import threading

import numpy as np
import torch

from reft_ext.report.events import reft_print
from reft_ext.store import handover
from reft_ext.store.atomic import write_atomic
from reft_ext.store.checksum import checksum
from reft_ext.store.paths import domain, job_dir
from reft_ext.store.shm import ShmSegment, check_space, ensure_private_dir


# ---- small metadata as JSON (RNG states, counters, scheduler) ------------------------
_PLAIN = (int, float, str, bool, type(None))
_PACK_MIN = 64  # ints in a sequence packed as bytes (shorter ones stay readable)


def to_jsonable(obj):
    # a long sequence of ints (Python's RNG state is 625) is their bytes: one JSON string,
    # not 625 numbers that every manifest's dump and seal walk (issue 57)
    if type(obj) in (tuple, list) and len(obj) >= _PACK_MIN and set(map(type, obj)) == {int}:
        try:
            packed = base64.b64encode(array.array("q", obj).tobytes()).decode()
        except OverflowError:  # beyond 64 bits: as numbers below
            pass
        else:
            return {"__int64__": packed, "tuple": type(obj) is tuple}
    # a sequence of plain values is itself
    if type(obj) in (tuple, list) and all(type(x) in _PLAIN for x in obj):
        return {"__tuple__": list(obj)} if type(obj) is tuple else list(obj)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {"__tensor__": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy()
                                               .tobytes()).decode(),
                "dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_jsonable(x) for x in obj]}
    if isinstance(obj, list):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {"__dict__": [[to_jsonable(k), to_jsonable(v)] for k, v in obj.items()]}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return obj


def from_jsonable(obj):
    if isinstance(obj, list):
        return [from_jsonable(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        raw = bytearray(base64.b64decode(obj["__tensor__"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, obj["dtype"])).reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        return np.frombuffer(base64.b64decode(obj["__ndarray__"]),
                             dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "__int64__" in obj:
        ints = array.array("q", base64.b64decode(obj["__int64__"])).tolist()
        return tuple(ints) if obj.get("tuple") else ints
    if "__tuple__" in obj:
        return tuple(from_jsonable(x) for x in obj["__tuple__"])
    if "__dict__" in obj:
        return {from_jsonable(k): from_jsonable(v) for k, v in obj["__dict__"]}
    return obj


SEAL = "self_sha256"  # the field of a manifest / commit pointer: digest of the rest


def _digest(obj: dict) -> str:
    """SHA-256 of the canonical JSON of ``obj`` without its seal (sorted keys: the same
    text after any JSON round trip)."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _str_keys(obj) -> bool:
    """Are the keys of every dict in ``obj`` strings? Then its sorted-key JSON text is
    what a reader's parse gives back, re-dumped: canonical as written."""
    if type(obj) is dict:
        return all(isinstance(k, str) for k in obj) and \
            all(_str_keys(v) for v in obj.values() if type(v) in _NESTED)
    return all(_str_keys(v) for v in obj if type(v) in _NESTED)


_NESTED = (dict, list, tuple)


def sealed(obj: dict) -> str:
    """The JSON text of ``obj`` carrying its own digest over exactly the text a reader
    parses back and re-dumps (:func:`_digest`). One sorted dump of the manifest (40 KB
    of RNG states) where every key is a string; through a parse first where not (an int
    key is sorted as a number before it becomes a string): four passes were 1 ms of
    every snapshot (issue 57)."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    if not _str_keys(body):
        body = json.loads(json.dumps(body))
    text = json.dumps(body, sort_keys=True)
    seal = f'"{SEAL}": "{hashlib.sha256(text.encode()).hexdigest()}"'
    return text[:-1] + (", " if body else "") + seal + "}"


def read_sealed(path: str) -> tuple[dict | None, str | None]:
    """(content without the seal, None), or (None, why) for a file that is not whole:
    it does not parse, is not an object, has no seal or fails its digest. A missing file
    raises OSError. No file older than the seal exists: one without it is torn or foreign."""
    with open(path) as f:
        text = f.read()
    try:
        obj = json.loads(text)
    except ValueError:
        return None, "does not parse as JSON"
    if not isinstance(obj, dict):
        return None, "is not a JSON object"
    want = obj.pop(SEAL, None)
    if want is None:
        return None, f"has no checksum ({SEAL}): torn or foreign"
    if want != _digest(obj):
        return None, f"fails its checksum ({SEAL})"
    return obj, None


def region_verified(data: torch.Tensor, manifest: dict, region: str) -> bool:
    """Does ``region`` of a slot's bytes (``data``) have the checksum its manifest
    recorded when it was written?"""
    off, n, crc = manifest["regions"][region]
    return n == 0 or checksum(data[off:off + n], manifest.get("checksum", "crc32")) == crc


def current_device() -> int | None:
    """The calling thread's CUDA device (None without CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


class SnapshotStore:
    def __init__(self, job_id: str, node: int, rank: int, base_dir: str, slots: int = 2):
        if slots < 2:
            raise ValueError("a snapshot store needs >= 2 slots (one committed, one written)")
        self.slots = tuple(range(slots))
        self.job = domain(job_id, node)  # the failure domain's segment namespace
        self.base_dir, self.rank = base_dir, rank
        self.dir = job_dir(self.job, base_dir)
        self._segs: dict[int, ShmSegment] = {}
        # (reserve(background=True)) the keys a thread is creating, what it made, its error
        self._pending: set = set()
        self._creator: threading.Thread | None = None
        self._made: dict = {}
        self._made_lock = threading.Lock()
        self._creator_error: BaseException | None = None
        # the thread makes the named buffers, then waits for this before the slots
        # (release_slots: the caller's recovery and start are done)
        self._slots_go = threading.Event()
        self._slots_skip = False  # settled before the release: the slots are not made
        self._reported: set = set()  # (path, why) already said: one line per bad file
        # page-lock the slots (state on a GPU: the D2H lands in the slot, asynchronously);
        # a slot made by the background reservation is locked there, others at begin()
        self.pin_slots = False
        # the device the slots are locked for: the caller's (the rank's), recorded on the
        # caller's thread; the reservation thread's own would be 0 (a new thread's), a
        # context on another rank's GPU (or refused under EXCLUSIVE_PROCESS)
        self.device: int | None = None
        # the commit pointer this store last wrote: begin() reads no file per iteration
        # (a new process reads the file once)
        self._pointer: dict | None = None

    def _name(self, slot: int, ext: str) -> str:
        return f"rank{self.rank}.slot{slot}.{ext}"

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _read(self, path: str, what: str) -> dict | None:
        """A sealed file's content, or None when it is missing or not whole (reported
        once per file and reason)."""
        try:
            obj, why = read_sealed(path)
        except OSError:
            return None
        if why is not None and (path, why) not in self._reported:
            self._reported.add((path, why))
            reft_print(f"rank {self.rank}: {path} {why}: {what}", event="untrusted_file",
                       rank=self.rank, path=path, why=why,
                       kind="commit_pointer" if path.endswith(".committed") else "manifest")
        return obj

    # ---- writing --------------------------------------------------------------
    def committed(self) -> dict | None:
        return self._read(self._path(f"rank{self.rank}.committed"),
                          "commit pointer ignored on this rank (the other ranks' "
                          "commits decide)")

    def begin(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """Open a slot for writing, never the committed one: an empty (or torn) slot
        first, else the oldest snapshot's. Its manifest goes first, so the slot reads as
        empty until :meth:`finish`."""
        c = self._pointer if self._pointer is not None else self.committed()
        current = c.get("slot") if c and c.get("slot") in self.slots else None
        if current is None and c is None:
            # no readable pointer (a fresh store, or a corrupt one): keep the newest
            # complete snapshot, which may be the committed one, and write another slot
            done = self.manifests()
            if done:
                current = max(done, key=lambda s: int(done[s].get("iteration", -1)))
        # ring order after the committed slot: filling the empty slots in this order
        # keeps it, so when none is empty the next in ring order is the oldest (no
        # manifest has to be read on this per-iteration path, only stat'ed)
        start = 0 if current is None else current + 1
        order = [(start + i) % len(self.slots) for i in range(len(self.slots))]
        order = [s for s in order if s != current]
        empty = [s for s in order if not os.path.exists(self._path(self._name(s, "json")))]
        slot = empty[0] if empty else order[0]
        try:
            os.unlink(self._path(self._name(slot, "json")))
        except FileNotFoundError:
            pass
        seg = self._segment(slot, nbytes)
        if self.pin_slots and not seg.pinned:
            if self.device is None:
                self.device = current_device()
            self._page_lock(seg)
        return slot, seg.tensor(torch.uint8, 0, nbytes)

    def _page_lock(self, seg: ShmSegment) -> None:
        """Page-locks a slot; where the driver refuses (a --reft-shm-dir that is not a
        tmpfs: cudaHostRegister takes no disk-backed mapping) the slots stay unlocked and
        device bytes go through pinned staging, said once."""
        try:
            seg.pin(device=self.device)
        except RuntimeError as exc:
            if self.pin_slots:
                self.pin_slots = False
                reft_print(f"rank {self.rank}: cannot page-lock the snapshot slots in "
                           f"{self.dir} ({exc}); device state is copied through pinned "
                           f"staging instead (slower: put --reft-shm-dir on a tmpfs such "
                           f"as /dev/shm)", event="slots_unlocked", rank=self.rank)

    def reserve(self, nbytes: int, buffers: dict | None = None,
                background: bool = False) -> None:
        """Every slot (``nbytes`` each) and the named ``buffers`` (name -> bytes, see
        :meth:`buffer`): existing ones are attached and grown now, space is checked now.
        ``background``: the segments that do not exist yet (a fresh start, or a
        replacement whose failure domain was lost: over a GB of pages to allocate and
        map) are created by a thread while the caller goes on (its REFT-load reads only
        existing segments); the first use of one waits for it, and raises its error.
        The thread makes the buffers at once and the slots after :meth:`release_slots`
        (a replacement's 1.7 GB of slots on the lost-node job took a core from its
        recovery and start-up; a snapshot needs them only an iteration later)."""
        # the buffers first: the live AOR replica is needed before the first step, the
        # slots only at the first snapshot
        want = [(name, self._buffer_name(name), n) for name, n in (buffers or {}).items()]
        want += [(slot, self._name(slot, "bin"), nbytes) for slot in self.slots]
        todo = []
        for key, fname, n in want:
            if key in self._segs or ShmSegment.exists(self.job, fname, base_dir=self.base_dir):
                self._open(key, fname, n)
            else:
                todo.append((key, fname, n))
        handover.release()  # a failed generation's segments this store did not claim
        if self.pin_slots and self.device is None:
            self.device = current_device()  # here, on the caller's thread
        if not background or not todo:
            for key, fname, n in todo:
                self._open(key, fname, n)
            return
        ensure_private_dir(self.dir)
        check_space(os.path.join(self.dir, todo[0][1]), sum(max(n, 1) for _, _, n in todo))
        self._pending = {key for key, _, _ in todo}
        self._creator = threading.Thread(target=self._create_all, args=(todo,),
                                         name="reft-shm-reserve", daemon=True)
        self._creator.start()

    def release_slots(self) -> None:
        """The background reservation may make the slots now (see :meth:`reserve`)."""
        self._slots_go.set()

    def _create_all(self, todo: list) -> None:
        try:
            if self.pin_slots and self.device is not None:
                # this thread's device is the rank's before any CUDA call (the page
                # locking): a new thread's is 0, where the runtime would make a context
                torch.cuda.set_device(self.device)
            for key, fname, n in todo:
                if key in self.slots:
                    self._slots_go.wait()
                    if self._slots_skip:  # made at a first use, if any comes
                        return
                seg = ShmSegment.create(self.job, fname, max(n, 1), base_dir=self.base_dir)
                if self.pin_slots and key in self.slots:
                    self._page_lock(seg)  # seconds for GBs: here, not at the first snapshot
                with self._made_lock:
                    self._made[key] = seg
        except BaseException as exc:  # noqa: BLE001 - raised at a first use (_wait)
            self._creator_error = exc

    def _take_made(self, key) -> bool:
        with self._made_lock:
            seg = self._made.pop(key, None)
        if seg is not None:
            self._segs[key] = seg
            self._pending.discard(key)
        return seg is not None

    def _wait(self, key) -> None:
        """A segment the background reservation is creating: wait until the thread has
        made it (each is published as soon as it is), or raise the thread's error."""
        if key not in self._pending:
            return
        if key in self.slots:
            self.release_slots()  # a first use before the release: made now
        while self._creator.is_alive():
            if self._take_made(key):
                return
            self._creator.join(0.005)
        if self._take_made(key):
            return
        self._settle()  # the thread ended without making it: what it did not make is
        err, self._creator_error = self._creator_error, None  # created at its first use
        if err is not None:
            raise err

    def _settle(self) -> None:
        """The background reservation is over: what it made joins the open segments."""
        if self._creator is not None:
            if not self._slots_go.is_set():  # never released (a start that failed)
                self._slots_skip = True
                self._slots_go.set()
            self._creator.join()
        with self._made_lock:
            self._segs.update(self._made)
            self._made.clear()
        self._pending = set()

    def _segment(self, slot: int, nbytes: int) -> ShmSegment:
        return self._open(slot, self._name(slot, "bin"), nbytes)

    def _buffer_name(self, name: str) -> str:
        return f"rank{self.rank}.{name}.bin"

    def _open(self, key, fname: str, nbytes: int) -> ShmSegment:
        """This rank's segment ``fname``, attached (after a restart) or created, and grown
        to ``nbytes``; kept open under ``key``."""
        self._wait(key)
        seg = self._segs.get(key)
        if seg is None:
            # a failed generation's store of this process may hold it mapped already
            seg = handover.claim(self._path(fname))
            if seg is None and ShmSegment.exists(self.job, fname, base_dir=self.base_dir):
                seg = ShmSegment.attach(self.job, fname, base_dir=self.base_dir)
            elif seg is None:
                seg = ShmSegment.create(self.job, fname, max(nbytes, 1), base_dir=self.base_dir)
            self._segs[key] = seg
        if seg.nbytes < nbytes:
            seg.resize(nbytes)
        return seg

    def buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """A named extra segment of this rank in the failure domain (e.g. the live AOR
        replica), created or attached and grown to ``nbytes``."""
        return self._open(name, self._buffer_name(name), nbytes).tensor(torch.uint8, 0, nbytes)

    def finish(self, slot: int, manifest: dict) -> None:
        """The slot is complete on this rank (not yet job-wide)."""
        write_atomic(self._path(self._name(slot, "json")), sealed(manifest), durable=True)

    def commit(self, slot: int, iteration: int) -> None:
        """This iteration's snapshot is committed on this rank: it is the one to keep
        (reft_ext/store/commit.py says when that is)."""
        write_atomic(self._path(f"rank{self.rank}.committed"),
                     sealed({"slot": slot, "iteration": iteration}), durable=True)
        self._pointer = {"slot": slot, "iteration": iteration}

    def discard_newer(self, iteration: int) -> None:
        """A rollback to ``iteration``: snapshots after it are dropped (their manifests go,
        so they read as torn and are the first slots written again) and the commit
        pointer goes back to ``iteration``'s slot."""
        keep_slot = None
        for slot, m in self.manifests().items():
            if int(m["iteration"]) > iteration:
                os.unlink(self._path(self._name(slot, "json")))
            elif int(m["iteration"]) == iteration:
                keep_slot = slot
        if keep_slot is not None:
            self.commit(keep_slot, iteration)

    # ---- reading --------------------------------------------------------------
    def manifests(self) -> dict[int, dict]:
        """slot -> manifest, for every slot whose manifest exists and is whole (a
        manifest that fails its checksum leaves its slot torn on this rank)."""
        out = {}
        for slot in self.slots:
            m = self._read(self._path(self._name(slot, "json")),
                           f"slot {slot} treated as torn on this rank (peers' redundancy "
                           f"or the persistent checkpoint replaces it)")
            if m is None:
                continue
            if ShmSegment.exists(self.job, self._name(slot, "bin"), base_dir=self.base_dir):
                out[slot] = m
        return out

    def mapped(self, nbytes: int) -> dict[int, torch.Tensor]:
        """slot -> its first ``nbytes``, for the slots this store has mapped now (nothing
        is created or attached here)."""
        return {k: seg.tensor(torch.uint8, 0, nbytes) for k, seg in list(self._segs.items())
                if k in self.slots and seg.nbytes >= nbytes}

    def data(self, slot: int, nbytes: int) -> torch.Tensor:
        return self._segment(slot, nbytes).tensor(torch.uint8, 0, nbytes)

    def verify(self, slot: int, manifest: dict, region: str) -> bool:
        """Does region's checksum still match what its owner computed from the source?"""
        if manifest["regions"][region][1] == 0:
            return True
        try:
            return region_verified(self.data(slot, manifest["nbytes"]), manifest, region)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._settle()  # a reservation still running: its segments are closed too
        for seg in self._segs.values():
            seg.close()
        self._segs.clear()

    def hand_over(self, reader=None) -> None:
        """A failed generation (in-process restart): the segments stay mapped for the
        next store of this process, which claims them instead of mapping them again
        (reft_ext/store/handover.py); ``reader``: a thread still reading them."""
        self._settle()
        handover.hand_over(self._segs.values(), reader)
        self._segs.clear()

    def remove(self) -> None:
        self.close()
        self._pointer = None
        ShmSegment.remove_job(self.job, base_dir=self.base_dir)
