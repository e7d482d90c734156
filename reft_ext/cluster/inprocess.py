"""In-process restart, the rank's side: survivors of a failure keep their process.

A job started by the in-process supervisor (reft_ext/cluster/supervisor.py, run by
``tools/launch_nodes.py --restart in-process``) lives in *generations*. Generation g's
process groups rendezvous under the store prefix ``reft/ip/g<g>/``; when any rank of g
dies, hangs or sees a collective fail, ``abort/<g>`` is set in the supervisor's store and

1. every rank's :class:`AbortWatcher` thread (woken through its mailbox) *aborts its
   communicators*, each backend by its own means (:func:`plan_abort`): NCCL groups by
   their own ``ProcessGroupNCCL.abort()`` (``ncclCommAbort``: it ends the kernels in
   flight and closes NCCL's sockets itself), then the CUDA streams are drained
   (bounded); gloo has no working ``abort()`` for a rank blocked in a collective
   (``ProcessGroup.abort`` returns and the wait goes on: measured on torch 2.13), so
   for gloo groups the watcher then shuts down the process's remaining peer TCP
   connections, which wakes every blocked gloo wait with an error. Where an abort is
   unsafe (an unknown backend, NCCL without CUDA) or fails (an error, a timeout), no
   socket is touched: the rank logs why and exits, a process restart;
2. the trainer catches the error (:meth:`Generation.is_failure` tells a peer's failure
   from a bug of its own), tears its groups down and reports ``ready/<g>/<rank>``;
3. the supervisor gives the dead ranks' places to replacements (warm spares when it has
   them) and publishes ``gen = g + 1``; every rank of g + 1 rendezvous again and rolls
   back to the snapshot every rank has committed.

A rank that cannot restart in place (a bug, a state it cannot rebind) just exits: the
supervisor replaces it like a dead one, so the worst case is today's process restart.
This module is torch-only (no megatron): the trainer's side is
megatron/training/inprocess.py.

The store listens on loopback only, but any local process can connect to it without a
password, so every value that steers the job (``abort/<g>``, ``gen``, a spare's
assignment, the ``ready``/``trained`` markers) carries an HMAC-SHA256 over (key,
generation, value) with the job's secret (:data:`ENV_SECRET`: 32 random bytes made by
the supervisor and handed to its workers in their environment, never through the
store). A value without a valid tag is ignored, with one warning per key.
"""

from __future__ import annotations

import datetime
import faulthandler
import hashlib
import hmac
import json
import os
import secrets
import signal
import threading
import time

import torch

# aborting the communicators (each backend by its own means) lives beside this module;
# its names are this module's API too
from reft_ext.cluster.comm_abort import (ABORT_TIMEOUT_S, AbortPlan,  # noqa: F401
                                         abort_communicators, peer_sockets, plan_abort,
                                         shutdown_peer_sockets)
# what a failure is (a peer's, or this rank's own) lives beside this module too
from reft_ext.cluster.failures import (PEER_ERRORS, PeerFailure, RestartError,  # noqa: F401
                                       causes, is_peer_error)
from reft_ext.report.threads import join_or_warn

ENV_STORE = "REFT_INPROCESS_STORE"      # host:port of the supervisor's store
ENV_GENERATION = "REFT_GENERATION"      # the generation this process joins first
ENV_SECRET = "REFT_INPROCESS_SECRET"   # hex of the job's 32-byte HMAC key (never stored)
PREFIX = "reft/ip"
POLL_S = 0.05                           # how often a rank looks for an abort
STACKS_SIGNAL = signal.SIGUSR2          # the supervisor's "write your stacks" before a kill
EXIT_UNSAFE_ABORT = 1                   # the watcher's exit where aborting failed

def enabled() -> bool:
    """Started by the in-process supervisor (else torchrun restarts processes)."""
    return bool(os.environ.get(ENV_STORE))


# NCCL's watchdog on a failed or timed-out collective (TORCH_NCCL_ASYNC_ERROR_HANDLING,
# read before its older name NCCL_ASYNC_ERROR_HANDLING): 0 does nothing, 2 aborts the
# communicators only; 1 aborts and ends the process, 3 (torch's default) ends it. An
# in-process restart keeps the survivors: only 0 and 2 let it.
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_KEEPS_SURVIVORS = ("0", "2")


def nccl_teardown_problem(env=None) -> tuple[str, str] | None:
    """(variable, why) when NCCL's error handling in ``env`` (default os.environ) would
    end a survivor the in-process restart means to keep; None when it would not."""
    env = os.environ if env is None else env
    for var in NCCL_ERROR_HANDLING_VARS:
        value = env.get(var)
        if value is None:
            continue
        if value.strip() in NCCL_KEEPS_SURVIVORS:
            return None
        return var, (f"{value} makes NCCL's watchdog end a surviving rank on a failed "
                     f"collective, which the in-process restart keeps: export {var}=0 "
                     f"(examples/slurm/reft_job.sh does for RESTART=in-process) or use "
                     f"--reft-restart process")
    return NCCL_ERROR_HANDLING_VARS[0], (
        "unset: torch's default (3) ends a surviving rank on a failed collective, which "
        "the in-process restart keeps: export TORCH_NCCL_ASYNC_ERROR_HANDLING=0 "
        "(examples/slurm/reft_job.sh does for RESTART=in-process) or use --reft-restart "
        "process")


def _connect(timeout_s: float) -> torch.distributed.TCPStore:
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    return torch.distributed.TCPStore(host, int(port), is_master=False,
                                      timeout=datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False)


def key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


# ---- authenticated store values ------------------------------------------------------
def new_secret() -> str:
    """A job's secret: 32 random bytes, hex (what :data:`ENV_SECRET` holds)."""
    return secrets.token_hex(32)


def job_secret() -> bytes:
    """This process's copy of the job's secret (from its environment)."""
    from reft_ext.cluster.signed_store import env_secret

    secret, why = env_secret(ENV_SECRET)
    if secret is None:
        raise RestartError(f"${ENV_SECRET} is {why}: the in-process supervisor hands it "
                           f"to every worker it starts")
    return secret


def _tag(secret: bytes, k: str, gen: int, value: str) -> str:
    msg = json.dumps([k, int(gen), value]).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, k: str, value: str, gen: int) -> str:
    """``value`` for store key ``k`` in generation ``gen``, with its HMAC tag."""
    return json.dumps({"g": int(gen), "v": value, "t": _tag(secret, k, gen, value)})


_warned: set[tuple[str, bool]] = set()  # (key, forged rather than replayed)


def forged(k: str, other_gen: int | None = None, gen: int | None = None) -> None:
    """Say once per key that a value without a valid tag (``other_gen`` None), or one
    signed for another generation than ``gen`` (a replay), was ignored."""
    if (k, other_gen is None) in _warned:
        return
    _warned.add((k, other_gen is None))
    from reft_ext.report.events import emit

    if other_gen is None:
        emit("store_forged", f"warning: unsigned/forged store value for {k} ignored", key=k)
    else:
        emit("store_replayed", f"warning: store value for {k} from another round "
             f"(generation {other_gen}, this is {gen}: replayed) ignored", key=k,
             round=other_gen)


def verify(secret: bytes, k: str, raw, gen: int | None = None) -> str | None:
    """The value of a signed store entry, or None (with the one warning) when it carries
    no valid tag for ``k`` (and for generation ``gen`` when given). An empty entry (a
    key never set, what compare_set's empty expectation leaves) is None, silently."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not raw:
        return None
    try:
        d = json.loads(raw)
        g, value, tag = d["g"], d["v"], d["t"]
        ok = (type(g) is int and isinstance(value, str) and isinstance(tag, str)
              and hmac.compare_digest(tag.encode(), _tag(secret, k, g, value).encode()))
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        forged(k)
        return None
    if gen is not None and g != gen:
        forged(k, g, gen)
        return None
    return value


def read_signed(store, secret: bytes, k: str, gen: int | None = None) -> str | None:
    """:func:`verify` of ``k``'s value; None when the key is not set."""
    if not store.check([k]):
        return None
    return verify(secret, k, store.get(k), gen)


def set_first(store, secret: bytes, k: str, value: str, gen: int) -> str:
    """Set ``k`` to the signed ``value`` unless a validly signed value is there already
    (the first reason wins); a forged value in its place is overwritten. Returns the
    value that stands."""
    signed = sign(secret, k, value, gen)
    expected = ""
    for _ in range(16):
        cur = store.compare_set(k, expected, signed)
        cur = cur.decode("utf-8", "replace") if isinstance(cur, bytes) else cur
        if cur == signed:
            return value
        good = verify(secret, k, cur, gen)
        if good is not None:
            return good
        expected = cur  # forged or unsigned: replace it
    store.set(k, signed)
    return value


def published_generation(store, secret: bytes) -> int | None:
    """The validly signed ``gen`` (its tag's generation must be its value), else None."""
    k = key("gen")
    if not store.check([k]):
        return None
    raw = store.get(k)
    value = verify(secret, k, raw)
    if value is None or not value.isdigit():
        return None
    g = int(value)
    return g if verify(secret, k, raw, g) is not None else None


class Generation:
    """This rank's view of the job's generations (one per process, kept across them)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.gen = int(os.environ.get(ENV_GENERATION, "0"))
        # a rank that does not stop after an abort is killed; its threads' stacks go to
        # its log first (the supervisor sends STACKS_SIGNAL): where it hung, for the user
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
        # NCCL's watchdog must not tear this process down on the errors our own abort
        # causes (torch's _abort_process_group note): the launch sets it for the mode,
        # the trainer's validation refused anything else (nccl_teardown_problem)
        self.secret = job_secret()
        self.store = _connect(timeout_s=24 * 3600)  # waits for the next generation
        self.store_port = int(os.environ[ENV_STORE].rsplit(":", 1)[1])
        self.aborted = threading.Event()
        self.abort_reason = ""
        self.abort_failure = ""  # why aborting in process failed: restart the process
        self._abort_lock = threading.Lock()  # the watcher and the trainer may both abort
        self.sockets_closed = 0
        self.device = None  # the CUDA device the trainer uses (drained at an abort)
        self._watcher: AbortWatcher | None = None
        # the pg store's and the abort watcher's connections, kept for the process's
        # life: made anew each generation, a recovery of W ranks opened 2W at once
        # (benchmarks/bench_control_plane.py: bursts stall connects by 5 s)
        self._clients: dict[str, torch.distributed.TCPStore] = {}

    def client(self, kind: str, timeout_s: float):
        """This process's ``kind`` connection to the supervisor's store (one per kind)."""
        c = self._clients.get(kind)
        if c is None:
            c = self._clients[kind] = _connect(timeout_s)
        else:
            c.set_timeout(datetime.timedelta(seconds=timeout_s))
        return c

    # ---- the process groups of one generation --------------------------------------
    def pg_store(self, timeout: datetime.timedelta):
        """The store generation g's process groups rendezvous on, its values signed with
        the job's secret: gloo's peer addresses and NCCL's unique id there would let a
        client that forged them stand in for a peer (whose objects are unpickled)."""
        from reft_ext.cluster.signed_store import SignedStore

        # gloo groups of more than EAGER_MAX ranks connect their pairs on first use
        # (reft_ext/cluster/groups.py gloo_group: a full mesh is W^2 store reads)
        prefix = key(f"g{self.gen}", "pg")
        store = self.client("pg", timeout.total_seconds())
        # bound to the generation: one copied from an older one's keys is said as a replay
        return SignedStore(torch.distributed.PrefixStore(prefix, store), self.secret,
                           key("pg"), round_id=f"generation {self.gen}")

    def watch(self) -> None:
        """Start the abort watcher for the current generation."""
        self.aborted.clear()
        self.abort_reason = self.abort_failure = ""
        # the trainer's device, from its thread (the current device is per thread)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._watcher = AbortWatcher(self)
        self._watcher.start()

    # ---- failure --------------------------------------------------------------------
    def request_abort(self, reason: str) -> None:
        """This rank saw generation g fail: every rank aborts (first reason wins)."""
        set_first(self.store, self.secret, key("abort", self.gen),
                  f"rank {self.rank}: {reason}", self.gen)
        notify(self.store)

    def is_failure(self, exc: BaseException) -> bool:
        """Is ``exc`` what a peer's failure (or our abort) looks like from here, rather
        than an error of this rank's own?"""
        return self.aborted.is_set() or is_peer_error(exc)

    def abort_now(self, reason: str) -> None:
        """Abort this rank's communicators (idempotent; called by the watcher thread,
        and by the trainer, which then finds :attr:`abort_failure` set or not)."""
        with self._abort_lock:
            if self.aborted.is_set():
                return
            self.abort_reason = reason
            _, self.sockets_closed, self.abort_failure = abort_communicators(
                {self.store_port}, self.device)
            self.aborted.set()

    def fall_back(self, why: str) -> None:
        """Aborting in process failed while the trainer may be blocked on the device:
        say why and exit; the supervisor replaces this rank like a dead one."""
        from reft_ext.report.events import emit

        emit("inprocess_unsafe", f"rank {self.rank}: in-process restart impossible "
             f"({why}); restarting as a new process", rank=self.rank, generation=self.gen,
             why=why)
        os._exit(EXIT_UNSAFE_ABORT)

    # ---- the next generation --------------------------------------------------------
    def next_generation(self, timeout_s: float, trained: int = 0) -> int:
        """Report this rank ready (its groups torn down) and wait until the supervisor
        publishes a newer generation; returns it. ``trained``: the iterations this rank
        had done (a replacement reads it: :meth:`survivors_trained`)."""
        if self._watcher is not None:
            self._watcher.stop(self.store)
            self._watcher = None
        old = self.gen
        self.request_abort("restart")  # in case this rank was the first to notice
        k = key("ready", old, self.rank)
        self.store.set(k, sign(self.secret, k, f"{os.getpid()} {int(trained)}", old))
        notify(self.store)
        deadline = time.monotonic() + timeout_s
        waited = False
        while time.monotonic() < deadline:
            g = self.published()
            if g is not None and g > old:
                self.gen = g
                os.environ[ENV_GENERATION] = str(g)  # fault injection's attempt
                return g
            if waited:  # gen/<g+1> is there but not validly signed: look again later
                time.sleep(POLL_S)
                continue
            try:  # blocks until the supervisor publishes g + 1 (no polling meanwhile)
                self.store.wait([key("gen", old + 1)], datetime.timedelta(
                    seconds=max(0.001, deadline - time.monotonic())))
            except torch.distributed.DistStoreError:
                break  # the timeout
            waited = True
        raise RestartError(f"no generation after {old} within {timeout_s:.0f} s "
                           f"(the supervisor is gone?)")

    def survivors_trained(self) -> bool:
        """(A replacement, in generation g >= 1) did a rank that keeps its process into
        this generation have trained (its ready mark of g - 1 says so)? Such a rank
        rolls back to committed state or, finding none, restarts as a new process
        (megatron/training/inprocess.py), so this generation's model is restored from
        host memory or --load as a whole, or this generation ends: the replacement's
        weight initialisation would be overwritten or thrown away."""
        if self.gen < 1:
            return False
        for r in range(self.world_size):
            if r == self.rank:
                continue
            v = read_signed(self.store, self.secret, key("ready", self.gen - 1, r),
                            self.gen - 1)
            parts = (v or "").split()
            if len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
                return True
        return False

    def published(self) -> int | None:
        """The generation the supervisor published last (None: no valid ``gen``)."""
        return published_generation(self.store, self.secret)

    def trained(self) -> None:
        """This rank finished an iteration in the current generation: the job is back to
        training (the supervisor refills its warm spares only then, so that their start
        never competes with a recovery for the host's cores)."""
        k = key("trained", self.gen, self.rank)
        self.store.set(k, sign(self.secret, k, "1", self.gen))

    def close(self) -> None:
        """Training is over: the abort watcher stops (a thread still inside a store call
        when the interpreter exits aborts the process)."""
        if self._watcher is not None:
            self._watcher.stop(self.store)
            self._watcher = None

    def reason(self) -> str:
        try:
            return read_signed(self.store, self.secret, key("abort", self.gen),
                               self.gen) or self.abort_reason
        except Exception:  # noqa: BLE001 - the store itself may be the failure
            return self.abort_reason


class AbortWatcher(threading.Thread):
    """Waits for ``abort/<g>`` and aborts the rank's communicators when it appears (its
    own store connection: the trainer's thread may be blocked in a collective). It
    blocks on its mailbox ``wake/<g>/<rank>`` (the supervisor fills every rank's at an
    abort: :func:`wake_ranks`; the rank fills its own to stop the watcher) instead of
    polling; after a wake that was neither (a value anyone could set) it polls."""

    def __init__(self, gen: Generation):
        super().__init__(name=f"reft-abort-watcher-g{gen.gen}", daemon=True)
        self.g, self.gen_no = gen, gen.gen
        self._halt = threading.Event()
        self.store = gen.client("watch", 60)

    def stop(self, store=None) -> None:
        self._halt.set()
        if store is not None:
            try:  # wake the blocked wait
                store.set(key("wake", self.gen_no, self.g.rank), "stop")
            except Exception:  # noqa: BLE001 - a store that is gone woke it already
                pass
        if not join_or_warn(self, 5, "the in-process restart's abort watcher",
                            generation=self.gen_no):
            self.g._clients.pop("watch", None)  # still in a call on it: the next one's own

    def _abort_if_set(self, k: str) -> bool:
        if self.store.check([k]):
            reason = read_signed(self.store, self.g.secret, k, self.gen_no)
            if reason:
                self.g.abort_now(reason)
                if self.g.abort_failure:
                    self.g.fall_back(self.g.abort_failure)
                return True
        return False

    def run(self) -> None:
        k = key("abort", self.gen_no)
        mailbox = key("wake", self.gen_no, self.g.rank)
        blocking = True
        while not self._halt.is_set():
            try:
                if self._abort_if_set(k):
                    return
                if blocking:
                    self.store.wait([mailbox], datetime.timedelta(days=7))
                    blocking = False  # woken: the mailbox stays set, poll from now on
                    continue
            except Exception as exc:  # noqa: BLE001 - the supervisor's store is gone
                if self._halt.is_set():
                    return
                self.g.abort_now(f"supervisor store unreachable: {exc}")
                if self.g.abort_failure:
                    self.g.fall_back(self.g.abort_failure)
                return
            self._halt.wait(POLL_S)


def notify(store, what: str = "") -> None:
    """Wake the supervisor, which blocks on the next ``ev/<n>`` (after setting anything
    it must act on: an abort request, a ready marker, a worker's exit: ``exit <wid>``).
    The value only says where to look (a forged one costs a lookup of a signed key)."""
    n = store.add(key("evseq"), 1)
    store.set(key("ev", n), what)


def wake_ranks(store, gen: int, ranks) -> None:
    """Fill every rank's abort-watcher mailbox of generation ``gen`` (one request)."""
    ks = [key("wake", gen, r) for r in ranks]
    if ks:
        store.multi_set(ks, ["abort"] * len(ks))
