"""The tools that read a checkpoint refuse one another user can write (issue 60, item 2).

A checkpoint's ``.metadata`` is a pickle (torch DCP's FileSystemReader.read_metadata):
another local user (a real second uid, ``setpriv``) who owns a checkpoint directory
replaced it with a pickle that writes a marker and returns the real metadata, and re-sealed
``integrity.json`` with the project's own index writer, so the checksums pass.
``tools/convert_checkpoint.py --to hf`` and ``tools/compare_checkpoints.py`` ran it as
this user. They now apply the trainer's --load check (megatron/training/path_checks.py)
before anything is loaded and refuse with one line naming --trust-shared-checkpoint-dir;
the control loads the same directory unchecked and the payload runs (the attack is real).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.harness.run import ENV_PATH, REPO
from tests.integration.test_rendezvous_security import OTHER_UID, SETPRIV, as_other_user

pytest.importorskip("transformers")
pytestmark = [as_other_user, pytest.mark.timeout(300)]

# uid OTHER_UID, in their own copy of a checkpoint: the payload pickle in place of
# .metadata (it writes the marker, then is the real metadata), integrity.json re-sealed
POISON = r"""
import operator, os, pickle, sys
sys.path.insert(0, sys.argv[3])
from megatron.training.checkpoint_integrity import checkpoint_files, hash_files, write_index
it_dir, marker = sys.argv[1:3]
meta = os.path.join(it_dir, ".metadata")
real = open(meta, "rb").read()
code = f"import os; open({marker!r}, 'w').write('uid=%d' % os.getuid())"
class Mark:
    def __reduce__(self):
        return (exec, (code, {}))
class Real:
    def __reduce__(self):
        return (pickle.loads, (real,))
class Both:
    def __reduce__(self):
        return (operator.getitem, ((Mark(), Real()), 1))
with open(meta, "wb") as f:
    f.write(pickle.dumps(Both()))
write_index(it_dir, 0, hash_files(it_dir, checkpoint_files(it_dir)))
print("poisoned and sealed by uid", os.getuid(), flush=True)
"""

# the control: the same .metadata read as torch DCP reads it, with no check
UNCHECKED = r"""
import sys
from torch.distributed.checkpoint import FileSystemReader
print("read:", type(FileSystemReader(sys.argv[1]).read_metadata()).__name__, flush=True)
"""


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", **ENV_PATH))


@pytest.fixture(scope="module")
def checkpoints():
    """(mine, theirs, marker): a real checkpoint of this user's, and uid OTHER_UID's
    poisoned, re-sealed copy, in a directory both can reach."""
    from tests.integration.test_hf_convert import _random_hf_llama

    shared = tempfile.mkdtemp(prefix="reft-tool-ckpt-", dir="/tmp")
    os.chmod(shared, 0o755)
    try:
        src, mine, theirs = (os.path.join(shared, n) for n in ("src", "mine", "theirs"))
        _random_hf_llama(src)
        r = tool("convert_checkpoint.py", "--to", "megatron", "--hf-model", src, "--save", mine)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        shutil.copytree(mine, theirs)
        for d, dirs, files in os.walk(theirs):
            os.chown(d, OTHER_UID, OTHER_UID)
            os.chmod(d, 0o755)
            for n in files:
                os.chown(os.path.join(d, n), OTHER_UID, OTHER_UID)
        marker = os.path.join(shared, "ran")
        it = os.path.join(theirs, "iter_0000000")
        r = subprocess.run([SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                            "--clear-groups", sys.executable, "-c", POISON, it, marker, REPO],
                           capture_output=True, text=True, timeout=120, cwd="/",
                           env=dict(os.environ, PYTHONPATH=""))
        assert f"poisoned and sealed by uid {OTHER_UID}" in r.stdout, r.stdout + r.stderr
        assert os.stat(os.path.join(it, "integrity.json")).st_uid == OTHER_UID

        # control: read unchecked, the payload runs as this user and returns the metadata
        r = subprocess.run([sys.executable, "-c", UNCHECKED, it], capture_output=True,
                           text=True, timeout=120)
        assert "read: Metadata" in r.stdout, r.stdout + r.stderr
        assert open(marker).read() == f"uid={os.getuid()}", "the control payload did not run"
        # and the checksums pass: only the owner check stands between it and a load
        from megatron.training.checkpoint_integrity import index_of, verify_files

        assert verify_files(it, index_of(it)) == []
        os.unlink(marker)
        yield mine, theirs, marker
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def refused_in_one_line(r: subprocess.CompletedProcess, theirs: str) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if theirs in ln]
    assert len(lines) == 1, r.stderr
    assert f"belongs to uid {OTHER_UID}" in lines[0] and \
        "--trust-shared-checkpoint-dir" in lines[0], lines[0]
    return lines[0]


def test_convert_checkpoint_refuses_another_users_checkpoint(checkpoints, tmp_path):
    mine, theirs, marker = checkpoints
    out = str(tmp_path / "hf")
    r = tool("convert_checkpoint.py", "--to", "hf", "--load", theirs, "--output", out)
    line = refused_in_one_line(r, theirs)
    assert line.startswith(f"convert_checkpoint: --load {theirs} "), line
    assert not os.path.exists(marker), "the payload ran in convert_checkpoint.py"
    assert not os.path.exists(out) or not os.listdir(out)


def test_compare_checkpoints_refuses_another_users_checkpoint(checkpoints):
    mine, theirs, marker = checkpoints
    for a, b in ((mine, theirs), (theirs, mine)):
        r = tool("compare_checkpoints.py", a, b)
        line = refused_in_one_line(r, theirs)
        assert line.startswith(f"error: checkpoint {theirs} "), line
        assert "identical" not in r.stdout
        assert not os.path.exists(marker), "the payload ran in compare_checkpoints.py"


@pytest.mark.slow
def test_trust_shared_checkpoint_dir_is_the_way_to_read_it_anyway(checkpoints, tmp_path):
    """With the flag, each tool reads the directory as asked (and so runs what its owner
    put there: the flag is for directories shared with users one trusts)."""
    mine, theirs, marker = checkpoints
    r = tool("compare_checkpoints.py", "--trust-shared-checkpoint-dir", mine, theirs)
    assert r.returncode == 0 and "identical" in r.stdout, r.stdout + r.stderr
    assert open(marker).read() == f"uid={os.getuid()}"
    os.unlink(marker)
    r = tool("convert_checkpoint.py", "--to", "hf", "--load", theirs, "--output",
             str(tmp_path / "hf"), "--trust-shared-checkpoint-dir")
    assert r.returncode == 0, r.stdout + r.stderr
    assert open(marker).read() == f"uid={os.getuid()}"
    os.unlink(marker)
