"""What a failure is (reft_ext/cluster/failures.py): a peer's death seen through whatever
wrapped it restarts a rank in process; an error of the rank's own does not. The first
test kills a real gloo peer in the middle of megatron-core's real dataset build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from reft_ext.cluster import inprocess
from reft_ext.cluster.failures import PeerFailure, RestartError, causes, is_peer_error
from tests.harness.run import ENV_PATH, REPO

# rank 1 leaves right before the datasets are built; rank 0 builds the mock datasets and
# meets megatron-core's barrier (blended_megatron_dataset_builder.py) without it: what it
# gets is megatron-core's Exception("MockGPTDataset failed to build ...") from gloo's error
_DATASET = textwrap.dedent("""
    import datetime, os, sys, time
    import torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    if rank == 0:  # (rank 1 only meets the first barrier: it imports nothing more)
        from megatron.training.arguments import parse_args
        from megatron.training.data import build_train_valid_test_datasets
        from megatron.training.tokenizer import build_tokenizer
        from reft_ext.cluster import inprocess
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=180))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        os._exit(0)
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                       "2", "--seq-length", "16", "--max-position-embeddings", "16",
                       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                       "64", "--micro-batch-size", "1", "--global-batch-size", "2",
                       "--train-iters", "2", "--lr", "1e-3"], world_size=2)
    tokenizer = build_tokenizer(args)
    time.sleep(1.0)  # rank 1 has exited: its sockets are closed
    try:
        build_train_valid_test_datasets(args, tokenizer)
        print("built")
    except Exception as exc:
        print("outer:", type(exc).__name__, exc)
        print("chain:", " <- ".join(type(e).__name__ for e in inprocess.causes(exc)))
        print("innermost:", str(inprocess.causes(exc)[-1])[:200].replace(chr(10), " "))
        print("peer:", inprocess.is_peer_error(exc))
""")


@pytest.mark.slow  # ~40 s on the loaded 2-core host (megatron's imports); the chains
# below are the default tier's, and test_inprocess_startup.py's data-build kill runs it
def test_a_peer_dying_inside_megatron_cores_dataset_build_is_a_peers_failure(tmp_path):
    from tools.launch_nodes import free_port

    port = free_port()
    script = tmp_path / "dataset.py"
    script.write_text(_DATASET)
    env = dict(os.environ, **ENV_PATH, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (0, 1)]
    try:
        out = procs[0].communicate(timeout=240)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # the real wrap: megatron-core's own exception, gloo's error as its cause
    assert "outer: Exception MockGPTDataset failed to build as a mock data generator" in \
        out, out[-3000:]
    assert "chain: Exception <- RuntimeError" in out, out[-3000:]
    assert "gloo" in out.split("innermost:")[1], out[-3000:]
    assert "peer: True" in out.splitlines(), out[-3000:]


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:11690")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer"
                ".cc:78] Timed out waiting 60000ms for recv operation to complete")


def _raised(make):
    """The exception ``make`` raises (so __cause__/__context__ are set as Python sets
    them, tracebacks and all)."""
    try:
        make()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def _wrapped(inner: BaseException, outer, implicit: bool = False):
    def make():
        try:
            raise inner
        except BaseException as e:  # noqa: BLE001
            if implicit:
                raise outer  # context only: raised while handling
            raise outer from e
    return _raised(make)


@pytest.mark.parametrize("exc, peer", [
    # gloo: a plain RuntimeError, told by its text
    (RuntimeError(GLOO_CLOSED), True),
    (RuntimeError(GLOO_TIMEOUT), True),
    # megatron-core's dataset build, a checkpoint load: wrapped with `from`, or raised
    # while handling (context only), or twice
    (_wrapped(RuntimeError(GLOO_CLOSED), Exception("MockGPTDataset failed to build")), True),
    (_wrapped(RuntimeError(GLOO_TIMEOUT), ValueError("cannot read common.pt"), True), True),
    (_wrapped(_wrapped(RuntimeError(GLOO_CLOSED), KeyError("x")), Exception("y")), True),
    # types before text: torch's DistError family, sockets, the rejoin's own verdict
    (_wrapped(torch.distributed.DistBackendError("NCCL error"), Exception("load")), True),
    (torch.distributed.DistStoreError("wait timeout"), True),
    (ConnectionResetError(104, "reset"), True),
    (PeerFailure("rank(s) [1] have no state to go on with"), True),
    (BaseExceptionGroup("threads", [ValueError("a"), RuntimeError(GLOO_CLOSED)]), True),
    # this rank's own errors, whatever their words
    (ValueError("bad value"), False),
    (Exception("Timed out waiting for the user"), False),  # text, but not gloo's types
    (_wrapped(RuntimeError(GLOO_CLOSED), RestartError("restarts as a new process")), False),
    (KeyError("Connection closed by peer"), False),
])
def test_failures_are_classified_by_their_whole_chain(exc, peer):
    assert is_peer_error(exc) is peer
    assert inprocess.is_peer_error(exc) is peer  # the in-process module's name for it


def test_a_cyclic_chain_ends():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert [str(e) for e in causes(a)] == ["a", "b"]
    assert not is_peer_error(a)
