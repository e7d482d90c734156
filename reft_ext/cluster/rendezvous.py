"""torchrun's dynamic rendezvous without pickle from the store: the ``reft`` backend.

torch's c10d rendezvous keeps the agents' shared state under ``torch.rendezvous.<run id>``
in a TCPStore and reads it back with ``pickle.loads``
(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py). The store has no login:
whoever reaches its port (another local user on loopback; any host when the store
listens on every interface, as ``torchrun --standalone``'s does) runs code in the agent.
The ``reft`` backend is the same dynamic rendezvous with three changes:

* the state is sealed with an HMAC-SHA256 under the job's secret (:data:`ENV_SECRET`,
  32 random bytes in hex, handed to every agent in its environment by the launcher,
  never through the store or a command line); a state that does not verify is refused
  with a one-line error before anything of it is parsed;
* a state that verifies is still parsed first by a restricted unpickler that admits the
  rendezvous state's own types only (:data:`STATE_TYPES`); torch's ``pickle.loads`` then
  sees exactly those bytes;
* every store it starts listens on the address the job names (the endpoint's host; the
  node's ``--local-addr`` for the workers' store), never on every interface, and the
  values of each round (the workers' ``MASTER_ADDR``/``MASTER_PORT``, their ranks) are
  signed too (reft_ext/cluster/signed_store.py).

The launchers of this project run it (``python -m reft_ext.cluster.torchrun``,
tools/launch_nodes.py, examples/slurm); the workers sign their process groups' store
with the same secret (:func:`worker_store_kwargs`). Under plain ``torchrun`` the trainer
says once what is exposed (:func:`launch_warning`).
"""

from __future__ import annotations

import datetime
import io
import os
import pickle

import torch
from torch.distributed.elastic.rendezvous import (RendezvousHandlerRegistry,  # noqa: F401
                                                  RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    DEFAULT_PORT, C10dRendezvousBackend)
from torch.distributed.elastic.rendezvous.utils import (_matches_machine_hostname,
                                                         parse_rendezvous_endpoint)

from reft_ext.cluster.signed_store import SignedStore, env_secret, seal, unseal

BACKEND = "reft"
ENV_SECRET = "REFT_RDZV_SECRET"   # hex of the job's 32-byte key (environment only)
ENV_ROUND = "REFT_RDZV_ROUND"     # the rendezvous round the agent's workers belong to
_DYN = dyn.__name__
# what a rendezvous state pickles to (torch 2.13): the state, node descriptors, times;
# sets and dicts are opcodes of their own
STATE_TYPES = frozenset({(_DYN, "_RendezvousState"), (_DYN, "_NodeDesc"),
                         ("datetime", "datetime"), ("datetime", "timezone"),
                         ("datetime", "timedelta")})
ANY_ADDRESS = ("", "0.0.0.0", "::", "*")
SECRET_HINT = (f"every agent of the job needs the same {ENV_SECRET} (32 random bytes, hex) "
               f"in its environment: export {ENV_SECRET}=$(python -c 'import secrets; "
               f"print(secrets.token_hex(32))') in the batch script, or launch with "
               f"tools/launch_nodes.py or python -m reft_ext.cluster.torchrun --standalone")


def job_secret() -> bytes:
    """The job's rendezvous key from the environment; a clear error when missing."""
    secret, why = env_secret(ENV_SECRET)
    if secret is None:
        raise RendezvousError(f"--rdzv-backend {BACKEND}: ${ENV_SECRET} is {why}: "
                              f"{SECRET_HINT}")
    return secret


# ---- the state: sealed, and parsed only as the state's own types ------------------------
class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in STATE_TYPES:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")
        return super().find_class(module, name)


def check_state(bits: bytes) -> None:
    """Raise unless ``bits`` unpickle to a rendezvous state using only :data:`STATE_TYPES`
    (nothing else is looked up, let alone called)."""
    try:
        state = _StateUnpickler(io.BytesIO(bits)).load()
    except Exception as exc:  # noqa: BLE001 - any parse failure is a refusal
        raise RendezvousStateError(f"the rendezvous state holds what a state never does "
                                   f"({type(exc).__name__}: {exc}): refused") from None
    if not isinstance(state, dyn._RendezvousState):
        raise RendezvousStateError(f"the rendezvous state is a {type(state).__name__}, "
                                   f"not a rendezvous state: refused")


class SignedStateBackend(dyn.RendezvousBackend):
    """torch's c10d backend with the state sealed under the job's secret."""

    def __init__(self, inner: C10dRendezvousBackend, secret: bytes, run_id: str,
                 where: str):
        self._inner, self._secret, self._run_id, self._where = inner, secret, run_id, where

    @property
    def name(self) -> str:
        return BACKEND

    def _seal(self, state: bytes) -> bytes:
        return seal(self._secret, "torch.rendezvous", self._run_id, state)

    def _open(self, bits: bytes) -> bytes:
        state = unseal(self._secret, "torch.rendezvous", self._run_id, bits)
        if state is None:
            raise RendezvousStateError(
                f"rendezvous {self._run_id!r} at {self._where}: the state in the store is "
                f"not signed with this job's {ENV_SECRET} (another client wrote it, or an "
                f"agent of another launch shares the run id): refused, nothing of it parsed")
        check_state(state)
        return state

    def get_state(self):
        got = self._inner.get_state()
        return None if got is None else (self._open(got[0]), got[1])

    def set_state(self, state: bytes, token=None):
        got = self._inner.set_state(self._seal(state), token)
        if got is None:
            return None
        bits, token, ok = got
        return self._open(bits), token, ok


class ReftRendezvousHandler(dyn.DynamicRendezvousHandler):
    """torch's dynamic rendezvous: its stores bound to the job's addresses, each round's
    values (MASTER_ADDR/PORT, the agents' ranks) signed."""

    _secret: bytes = b""
    _round: int | None = None  # the round _get_store was made for

    def _create_tcp_store_server(self, master_addr, master_port):
        from reft_ext.cluster.supervisor import listen

        return listen(master_addr, master_port, multi_tenant=True, wait_for_workers=False)

    def _get_store(self):
        # the round's values are bound to it (a replay of an older round's is said as one)
        self._round = self._state_holder.state.round
        return SignedStore(super()._get_store(), self._secret,
                           f"torch.rendezvous.{self._settings.run_id}",
                           round_id=f"round {self._round}")

    def next_rendezvous(self):
        """torch's, then the round in this agent's environment: the workers it starts
        inherit it and bind their store's values to it (:func:`worker_store_kwargs`)."""
        info = super().next_rendezvous()
        os.environ[ENV_ROUND] = str(self._round)
        return info


# ---- the endpoint's store and the handler ---------------------------------------------
def _endpoint_store(params: RendezvousParameters):
    from reft_ext.cluster.supervisor import listen

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))
    is_host = params.get_as_bool("is_host")
    inferred = is_host is None and port != 0
    if port == 0:  # nothing to connect to: this agent hosts it (--standalone)
        is_host = True
    elif is_host is None:
        is_host = _matches_machine_hostname(host)
    if is_host:
        if host in ANY_ADDRESS:
            raise RendezvousError(f"--rdzv-endpoint {params.endpoint}: name the address the "
                                  f"agents reach (127.0.0.1 on one host, the first node's "
                                  f"address on a cluster), not every interface")
        try:
            return listen(host, port, multi_tenant=True, wait_for_workers=False,
                          timeout=timeout)
        except OSError:
            if not inferred:
                raise
    return torch.distributed.TCPStore(host, port, is_master=False, multi_tenant=True,
                                      timeout=timeout)


def create_handler(params: RendezvousParameters) -> ReftRendezvousHandler:
    """The ``reft`` backend's handler (torch's create_handler, with our parts)."""
    secret = job_secret()
    store = _endpoint_store(params)
    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    where = f"{host}:{store.port}"
    backend = SignedStateBackend(C10dRendezvousBackend(store, params.run_id), secret,
                                 params.run_id, where)
    timeout = dyn.RendezvousTimeout(*(dyn._get_timeout(params, k) for k in
                                      ("join", "last_call", "close", "heartbeat")))
    handler = ReftRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes,
        params.local_addr, timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3))
    handler._secret = secret
    os.environ["REFT_RDZV_BACKEND"] = BACKEND  # the workers' launch_warning reads it
    return handler


def register() -> None:
    """Make ``--rdzv-backend reft`` known to torchrun in this process (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


# ---- the workers' side ------------------------------------------------------------------
def worker_store_kwargs(timeout: datetime.timedelta) -> dict:
    """init_process_group's store under torchrun: signed with the job's secret when the
    launcher gave one, the rank-0 store bound to MASTER_ADDR (torch's env:// would listen
    on every interface). {} where torch's own env:// is used unchanged."""
    from reft_ext.cluster.supervisor import listen

    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "MASTER_ADDR" not in env:
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    secret = None
    if env.get(ENV_SECRET):
        secret = job_secret()
    elif not shared:
        return {}
    if shared:  # the agent's store, a client of it (its server is the rank-0 agent's)
        store = torch.distributed.TCPStore(addr, port, world, is_master=False,
                                           timeout=timeout)
    elif rank == 0:
        store = listen(addr, port, multi_tenant=True, wait_for_workers=False,
                       timeout=timeout)
    else:
        store = torch.distributed.TCPStore(addr, port, is_master=False, timeout=timeout,
                                           wait_for_workers=False)
    # torchrun (2.13) shares its agent's store across restarts without a per-attempt
    # prefix: gloo would read the previous attempt's (dead) peer addresses. A store of
    # our own is new each round; there the restart count must not name it: a spare
    # node's fresh agent counts from 0 while a survivor's counts its restarts
    scope = f"reft/attempt_{attempt}" if shared else "reft/workers"
    store = torch.distributed.PrefixStore(scope, store)
    if secret is not None:
        store = SignedStore(store, secret, f"{env['TORCHELASTIC_RUN_ID']}/{scope}",
                            round_id=worker_round())
    return dict(store=store, rank=rank, world_size=world)


def worker_round() -> str:
    """What the workers' store values are bound to: the agents' rendezvous round (the
    ``reft`` handler's, in the environment) and the round's master address and port
    (signed in that round's store), the same on every rank of a round and new in the next:
    a value another client copied from an older round's store into this one's (the store
    has no login) is refused as one from another round."""
    env = os.environ
    return f"round {env.get(ENV_ROUND, '?')} {env['MASTER_ADDR']}:{env['MASTER_PORT']}"


def launch_warning() -> str | None:
    """What rank 0 says once when the job was launched by plain torchrun."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or env.get("REFT_RDZV_BACKEND") == BACKEND or \
            env.get("REFT_INPROCESS_STORE"):  # the in-process supervisor's workers
        return None
    return ("warning: launched by torchrun's own rendezvous: its TCPStore "
            f"({env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')} and the "
            "rendezvous endpoint) has no login, torch unpickles the rendezvous state "
            "from it, and --standalone listens on every interface: any client that "
            "reaches it can run code as this user. Launch with `python -m "
            "reft_ext.cluster.torchrun` (torchrun's flags; --standalone binds 127.0.0.1) "
            "or tools/launch_nodes.py (docs/security.md)")
