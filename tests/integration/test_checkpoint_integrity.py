"""Persistent checkpoints: the independent comparison (tools/compare_checkpoints.py) sees a
single flipped bit, and a checkpoint whose files do not match their checksums is refused
at --load, the newest older one that verifies loaded instead, and kept aside when that
iteration is saved again (megatron/training/checkpoint_integrity.py)."""

import io
import os
import shutil
import stat
import struct
import subprocess
import sys
import zipfile

import pytest

from tests.harness.compare import same_as_reference
from tests.harness.recovery import N
from tests.harness.run import LAYOUTS, REPO, TINY, torchrun

from megatron.training.checkpoint_integrity import INDEX, index_of, verify_files

LAYOUT = TINY + N + LAYOUTS["pp2dp2-zero1"]  # the reference shared with the recovery tests
TOOL = [sys.executable, os.path.join(REPO, "tools", "compare_checkpoints.py")]


def _iter_dir(root: str) -> str:
    it = int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())
    return os.path.join(root, f"iter_{it:07d}")


def flip_bit_of_element(ckpt: str, fqn_suffix: str, element: int, bit: int = 0) -> str:
    """Flip one bit of one element of the first stored tensor whose name ends with
    ``fqn_suffix``, inside its .distcp file (DCP stores each tensor as a torch.save zip
    at the offset its .metadata records). Returns the file's name and the element's index
    in the whole (unsharded) tensor, for a 1-D one such as an optimizer bucket."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(ckpt).read_metadata()
    idx, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn.endswith(fqn_suffix))
    itemsize = meta.state_dict_metadata[idx.fqn].properties.dtype.itemsize
    path = os.path.join(ckpt, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
        entry = next(e for e in zipfile.ZipFile(io.BytesIO(blob)).infolist()
                     if "/data/" in e.filename)
        name_len, extra_len = struct.unpack(
            "<HH", blob[entry.header_offset + 26:entry.header_offset + 30])
        at = info.offset + entry.header_offset + 30 + name_len + extra_len + \
            element * itemsize + bit // 8
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << (bit % 8))]))
    return info.relative_path, idx.offset[0] + element


# slow tier (make test's budget): the oracle's compare runs in every recovery test
@pytest.mark.slow
def test_compare_catches_one_flipped_bit_in_an_optimizer_moment(tmp_path, reference_runs):
    ref = reference_runs("pp2dp2-zero1", 4, LAYOUT)
    # ("identical": every recovery test's same_state, through compare_paths)
    copy = str(tmp_path / "copy")
    shutil.copytree(ref.checkpoint, copy)
    shard, where = flip_bit_of_element(_iter_dir(copy), ".exp_avg", element=100, bit=3)
    out = subprocess.run([*TOOL, ref.checkpoint, copy], capture_output=True, text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "exp_avg" in line]
    # one item, one element: the first moment's element 100 of its shard, nothing else
    assert out.stdout.startswith("1 of ") and len(rows) == 1, out.stdout
    assert ".exp_avg " in rows[0] and "(1 differ)" in rows[0] and "exp_avg_sq" not in rows[0]
    assert f" ({where},) (1 differ)" in rows[0], (where, rows[0])
    # and the checksums name the file, without loading anything
    verify = subprocess.run([*TOOL, "--verify", copy], capture_output=True, text=True)
    assert verify.returncode == 1 and f"{shard}: SHA-256 differs" in verify.stdout, verify.stdout
    ok = subprocess.run([*TOOL, "--verify", ref.checkpoint], capture_output=True, text=True)
    assert ok.returncode == 0 and "verified (" in ok.stdout, ok.stdout


def test_every_file_of_a_checkpoint_is_covered(tmp_path, reference_runs):
    """A flipped byte in any file of a checkpoint (every shard, the metadata, the common
    state) is named by the verification, and only that file."""
    ref = reference_runs("pp2dp2-zero1", 4, LAYOUT)
    copy = str(tmp_path / "copy")
    shutil.copytree(_iter_dir(ref.checkpoint), copy)
    index = index_of(copy)
    assert verify_files(copy, index) == []
    names = sorted(index["files"])
    assert ".metadata" in names and "common.pt" in names and \
        sum(n.endswith(".distcp") for n in names) >= 4, names
    for name in names:
        path = os.path.join(copy, name)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(path, "wb").write(bytes(data))
        assert verify_files(copy, index) == [f"{path}: SHA-256 differs from {INDEX} "
                                             f"(corrupted)"], name
        data[len(data) // 2] ^= 0x40
        open(path, "wb").write(bytes(data))
    os.unlink(os.path.join(copy, INDEX))  # no index: a save that never finished
    try:
        index_of(copy)
    except Exception as exc:  # noqa: BLE001
        assert "is missing: the save did not finish" in str(exc)
    else:
        raise AssertionError("a checkpoint without its index was accepted")


@pytest.mark.slow  # make test's 12 minutes; the default tier's refusal of a corrupt
# checkpoint: test_train_bad_input.py::test_load_corrupt_checkpoint_fails_clearly_and_touches_nothing
def test_corrupt_checkpoint_is_refused_and_the_previous_one_loaded(tmp_path, reference_runs):
    """Iteration 4's checkpoint has one flipped byte in a shard of rank 2's: --load refuses
    it naming the file, loads iteration 2, and the run ends bit-identical to the
    failure-free run (iterations 3-6 trained again from the verified state)."""
    ref = reference_runs("pp2dp2-zero1", 4, LAYOUT)
    save = str(tmp_path / "ckpt")
    # the reference's flags (its LR schedule), stopped after iteration 4
    first = torchrun(4, LAYOUT + ["--save", save, "--save-interval", "2",
                                  "--exit-interval", "4"]).check()
    assert "saved checkpoint at iteration       4" in first.output
    # the user's alone (docs/security.md): directories 0700, tracker and index 0600
    modes = {p: stat.S_IMODE(os.stat(os.path.join(save, p)).st_mode) for p in
             ("", "iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt",
              f"iter_0000004/{INDEX}")}
    assert modes == {"": 0o700, "iter_0000002": 0o700, "iter_0000004": 0o700,
                     "latest_checkpointed_iteration.txt": 0o600,
                     f"iter_0000004/{INDEX}": 0o600}, modes
    shard, _ = flip_bit_of_element(os.path.join(save, "iter_0000004"), ".exp_avg_sq",
                                   element=7, bit=30)
    run = torchrun(4, LAYOUT + ["--save", save, "--load", save, "--save-interval", "2"]).check()
    bad = os.path.join(save, "iter_0000004", shard)
    assert f"checkpoint {save}/iter_0000004 refused: {bad}: SHA-256 differs" in run.output
    assert f"loading {save}/iter_0000002 instead" in run.output, run.output[-3000:]
    refused = run.events.one("checkpoint_refused", rank=0)
    assert refused["iteration"] == 4 and refused["problems"] == \
        [f"{bad}: SHA-256 differs from {INDEX} (corrupted)"], refused
    assert f"loaded checkpoint {save}/iter_0000002 at iteration 2" in run.output
    same_as_reference(run, ref, 3)
    # iteration 4 saved again: the refused directory was kept aside, not overwritten
    aside = os.path.join(save, "iter_0000004.refused")
    assert f"[REFT] kept {save}/iter_0000004 aside as {aside}" in run.output
    assert verify_files(aside, index_of(aside)) == [
        f"{aside}/{shard}: SHA-256 differs from {INDEX} (corrupted)"]
    new = os.path.join(save, "iter_0000004")
    assert verify_files(new, index_of(new)) == []
