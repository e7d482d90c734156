"""The copy-and-hash pipeline on a CUDA device (tools/gpu_pipeline_check.py's checks, small):
native digests of device tensors equal chunk_digest of the slot bytes, and the side
stream waits for the post-step event (a fill_ queued behind a _sleep is in the snapshot)."""

from __future__ import annotations

import pytest
import torch

from reft_ext import _native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not _native.HAVE_NATIVE_CUDA,
                                reason="needs CUDA and reft_ext._C's CUDA part")


@pytest.mark.parametrize("threads", [1, 3])
def test_native_digests_of_device_tensors_equal_chunk_digest(threads):
    from tools.gpu_pipeline_check import check_digests  # noqa: PLC0415

    assert check_digests((24 << 20) + 999, threads) == []


def test_the_snapshot_waits_for_the_post_step_event():
    from tools.gpu_pipeline_check import check_ordering  # noqa: PLC0415

    assert check_ordering(16 << 20) == []
