"""Which process groups may carry what, and how each is aborted: REFT's host-tensor
group must be gloo for the CPU (never megatron's NCCL data-parallel group), and an
in-process restart aborts NCCL groups by NCCL's own abort and gloo groups by socket
shutdown, refusing (a process restart) anything it cannot abort safely."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from reft_ext.cluster import comm_abort, inprocess
from reft_ext.cluster.comm_abort import AbortPlan, plan_abort

from megatron.training.reft_integration import host_dp_group, host_group_refusal


@pytest.mark.parametrize("backend,ok", [
    ("gloo", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True),
    ("nccl", False), ("cuda:nccl", False), ("cpu:mpi,cuda:nccl", False), ("ucc", False)])
def test_host_group_refusal_by_backend(backend, ok):
    why = host_group_refusal(backend)
    assert (why is None) == ok, why
    if not ok:
        assert repr(backend) in why and "gloo needed" in why


def test_abort_plan_gives_each_backend_its_own_abort():
    # a GPU job: NCCL default and model-parallel groups, megatron's gloo DP groups
    plan = plan_abort([("0", "cpu:gloo,cuda:nccl"), ("1", "nccl"), ("2", "gloo")],
                      cuda_available=True, nccl_available=True)
    assert plan == AbortPlan(nccl=("0", "1"), sockets=True, unsafe="")
    # NCCL only: aborted by NCCL, no socket is touched
    assert plan_abort([("0", "nccl")], True, True) == AbortPlan(("0",), False, "")
    # today's CPU jobs: gloo only, socket shutdown as before
    assert plan_abort([("0", "gloo"), ("1", "gloo")], False, False) == \
        AbortPlan((), True, "")
    # unsafe: NCCL groups in a process without CUDA, or a backend with no known abort
    assert "without CUDA/NCCL" in plan_abort([("0", "nccl")], False, True).unsafe
    unsafe = plan_abort([("0", "gloo"), ("3", "mpi")], True, True).unsafe
    assert "group 3" in unsafe and "'mpi'" in unsafe


def test_bounded_reports_errors_and_hangs():
    assert comm_abort._bounded(lambda: None, 5, "noop") == ""
    assert "boom" in comm_abort._bounded(lambda: _raise("boom"), 5, "x")
    t0 = time.monotonic()
    assert "did not return within" in comm_abort._bounded(lambda: time.sleep(3), 0.2, "hang")
    assert time.monotonic() - t0 < 2


def _raise(msg):
    raise RuntimeError(msg)


@pytest.fixture
def gloo_world(tmp_path):
    """A single-process gloo world (the real groups, no peers)."""
    from megatron.core import parallel_state as mpu

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield mpu
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def test_host_dp_group_is_megatrons_gloo_group_or_one_made_here(gloo_world):
    mpu = gloo_world
    mpu.initialize_model_parallel(1, 1)
    assert host_dp_group([[0]]) is mpu.get_data_parallel_group_gloo()
    mpu.destroy_model_parallel()
    # megatron-core without gloo groups: one is made (not its DP group handed over)
    mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    g = host_dp_group([[0]])
    assert g is not mpu.get_data_parallel_group()
    assert str(dist.get_backend(g)) == "gloo" and dist.get_process_group_ranks(g) == [0]


def test_abort_in_a_gloo_world_shuts_sockets_only(gloo_world):
    plan, closed, failure = comm_abort.abort_communicators(set(), device=None)
    assert failure == "" and plan.nccl == () and plan.sockets
    assert closed == 0  # one process: no peer connection to shut
