"""Paths opened from a safe root, and job ids kept distinct (issue 48, items 2 and 3).

The attempts of the issue, repeated with a real second uid (``setpriv`` as user nobody;
skipped with the reason where not root): the parent of the dataset cache swapped with
``renameat2(RENAME_EXCHANGE)`` after the check changes nothing (megatron-core reads the
checked directory through its held descriptor; the swap really happened, and the by-name
read it would have made runs the payload); an XDG_CACHE_HOME below another user's
directory is refused; a symbolic-link flush or log directory is refused; ids that
sanitise alike get different directories; a --load or --save directory another user can
write is refused by name.
"""

import os
import pickle
import shutil
import stat
import subprocess
import tempfile

import pytest

from reft_ext.config import ReftConfig, ReftConfigError, _job_id_of, default_job_id
from reft_ext import safe_dir
from reft_ext.store import paths

NOBODY = 65534
IS_ROOT = os.geteuid() == 0
SETPRIV = shutil.which("setpriv")
PY = "/usr/bin/python3"  # one user nobody can run (the venv's lives under /root)
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
needs_setpriv = pytest.mark.skipif(
    not (IS_ROOT and SETPRIV and os.access(PY, os.X_OK)),
    reason="acting as user nobody needs root, setpriv (util-linux) and /usr/bin/python3")

EXCHANGE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2):  # EXCHANGE
    raise OSError(ctypes.get_errno(), "renameat2")
"""


def as_nobody(*cmd):
    subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                    "--clear-groups", *cmd], check=True, timeout=30)


@pytest.fixture
def shared():
    """A directory of root's in /tmp that user nobody can reach (0755)."""
    d = tempfile.mkdtemp(prefix="reft-safe-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- the helper ----------------------------------------------------------------------
def test_walk_checks_every_directory_above(tmp_path):
    d = tmp_path / "a" / "b"
    with safe_dir.open_dir(str(d), create=True) as held:
        assert held.path == str(d) and os.listdir(held.proc_path) == []
        fd = held.open("f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.close(fd)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and (d / "f").is_file()
    os.chmod(tmp_path / "a", 0o777)  # anyone could rename b: refused, naming a
    why = safe_dir.problem(str(d))
    assert why.startswith(f"is below {tmp_path / 'a'}, which is writable by group or others")
    os.chmod(tmp_path / "a", 0o1777)  # sticky: only b's owner (this user) can rename it
    assert safe_dir.problem(str(d)) is None
    (tmp_path / "link").symlink_to(d)
    assert safe_dir.problem(str(tmp_path / "link")).startswith("is a symbolic link")
    # a link above the last component, made by this user in a safe directory: followed
    with safe_dir.open_dir(str(tmp_path / "link" / ".."), create=False) as held:
        assert held.path == str(tmp_path)  # (lexically: abspath first, as os.path does)
    (tmp_path / "a" / "b" / "c").mkdir()
    with safe_dir.open_dir(str(tmp_path / "link" / "c")) as held:
        assert held.path == str(d / "c")


@needs_root
def test_a_link_or_directory_of_another_user_on_the_way_is_refused(tmp_path):
    os.chmod(tmp_path, 0o1777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "d").mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    assert f"{theirs}, which belongs to uid {NOBODY}" in safe_dir.problem(str(theirs / "d"))
    (tmp_path / "ln").symlink_to(tmp_path)
    os.lchown(tmp_path / "ln", NOBODY, NOBODY)  # their link in a sticky directory
    with pytest.raises(safe_dir.UnsafePathError, match=f"symbolic link of uid {NOBODY}"):
        safe_dir.open_dir(str(tmp_path / "ln" / "x"))


# ---- the dataset cache ---------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.training.dataset_files import ensure_preprocessed
    from tests.unit.test_data import write_jsonl

    d = tmp_path_factory.mktemp("safecorpus")
    write_jsonl(d / "tiny.jsonl", [f"doc {i}: " + "w " * (5 + i % 30) + "\n"
                                   for i in range(200)])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(d / "xdg"))
        return ensure_preprocessed(str(d / "tiny.jsonl"))


class Payload:
    """What the other user plants: unpickled, it creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@needs_setpriv
def test_cache_parent_swapped_after_the_check_changes_nothing(corpus, shared, monkeypatch):
    from megatron.training import data as data_mod, data_cache_dir, dataset_cache
    from megatron.training.tokenizer import build_tokenizer
    from tests.unit.test_data import make_args

    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(shared, "xdg"))
    monkeypatch.setattr(data_cache_dir, "_held", {})
    monkeypatch.setattr(dataset_cache, "_kept", {})
    args = make_args(data_path=[corpus], data_cache_path=os.path.join(shared, "p", "cache"))
    good = data_mod.build_train_valid_test_datasets(args, build_tokenizer(args))[0]
    fp = data_cache_dir._data_fingerprint([corpus])
    real = os.path.join(shared, "p", "cache", fp)
    names = sorted(n for n in os.listdir(real) if n.endswith(".npy"))
    assert names

    # the other user's copy: the same names, each a pickle that leaves a marker
    marker = os.path.join(shared, "ran")
    evil = os.path.join(shared, "evil", "cache", fp)
    os.makedirs(evil)
    for n in names:
        with open(os.path.join(evil, n), "wb") as f:
            pickle.dump(Payload(marker), f)
    for n in os.listdir(real):
        if not n.endswith(".npy"):
            shutil.copy(os.path.join(real, n), evil)
    for r, ds, fs in os.walk(os.path.join(shared, "evil")):
        for x in [r] + [os.path.join(r, e) for e in ds + fs]:
            os.chown(x, NOBODY, NOBODY)

    # a new start: the check passes (every directory root's or this user's) and the
    # directory is held ...
    monkeypatch.setattr(data_cache_dir, "_held", {})
    monkeypatch.setattr(dataset_cache, "_kept", {})
    held = data_cache_dir.data_cache_path(args, [corpus])
    assert held.startswith("/proc/self/fd/")
    # ... then, before megatron-core opens the index files, the other user swaps the
    # parent (here given the right to: the hook point of the attack)
    os.chmod(shared, 0o777)
    inode = os.stat(os.path.join(shared, "evil")).st_ino
    as_nobody(PY, "-c", EXCHANGE, os.path.join(shared, "p"), os.path.join(shared, "evil"))
    assert os.stat(os.path.join(shared, "p")).st_ino == inode  # the swap happened

    again = data_mod.build_train_valid_test_datasets(args, build_tokenizer(args))[0]
    assert not os.path.exists(marker)
    assert len(again) == len(good) and all(
        (again[i]["tokens"] == good[i]["tokens"]).all() for i in (0, len(good) - 1))
    # by name, as before, the same read runs the other user's code
    import numpy
    numpy.load(os.path.join(shared, "p", "cache", fp, names[0]), allow_pickle=True)
    assert os.path.exists(marker)


@needs_root
def test_cache_below_another_users_directory_is_refused(corpus, shared, monkeypatch):
    """The issue's set-up: XDG_CACHE_HOME below a directory another user owns; the job's
    own 0700 cache there passed the old check."""
    from megatron.training import data as data_mod, data_cache_dir
    from megatron.training.tokenizer import build_tokenizer
    from tests.unit.test_data import make_args

    theirs = os.path.join(shared, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, NOBODY, NOBODY)
    xdg = os.path.join(theirs, "xdg")
    os.mkdir(xdg, 0o700)  # (root may write there; the job's own directory, as in the issue)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setattr(data_cache_dir, "_held", {})
    msg = data_cache_dir.data_cache_path_error(None)
    assert msg and "\n" not in msg and f"{theirs}, which belongs to uid {NOBODY}" in msg
    with pytest.raises(data_cache_dir.UnsafeCacheDirError):
        args = make_args(data_path=[corpus])
        data_mod.build_train_valid_test_datasets(args, build_tokenizer(args))


# ---- the flush and log directories ---------------------------------------------------
def test_symlinked_flush_dir_is_refused(tmp_path):
    from reft_ext.cluster import watcher
    from reft_ext.load.flushed import trusted_flush_dir

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "flush"
    link.symlink_to(real)
    with pytest.raises(ReftConfigError, match=f"--reft-flush-dir: {link} is a symbolic link"):
        ReftConfig(flush_dir=str(link))
    with pytest.raises(watcher.FlushDirError, match="symbolic link"):
        watcher.flush_node(str(tmp_path / "node"), str(link))
    assert not trusted_flush_dir(str(link))
    assert os.listdir(real) == []
    assert ReftConfig(flush_dir=str(real)).flush_dir == str(real)


def test_symlinked_log_dir_or_planted_log_is_refused(tmp_path):
    from tools.launch_config import LaunchConfig, LaunchError
    from tools.launch_nodes import NodeLauncher

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "logs").symlink_to(real)
    with pytest.raises(LaunchError, match="--log-dir: .* is a symbolic link"):
        LaunchConfig(nnodes=1, job_id="logtest", log_dir=str(tmp_path / "logs"))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (real / "node0.0.log").symlink_to(victim)
    L = NodeLauncher(LaunchConfig(nnodes=1, job_id="logtest", log_dir=str(real)), [])
    with pytest.raises(LaunchError, match="node0.0.log"):
        L.start_node(0)
    assert victim.read_text() == "precious\n" and not L.procs


# ---- job ids -------------------------------------------------------------------------
def test_ids_that_sanitise_alike_get_different_directories(tmp_path):
    ids = [ReftConfig(job_id=j).job_id for j in ("exp/1", "exp 1", "exp_1")]
    assert len(set(ids)) == 3 and ids[2] == "exp_1"
    assert len({paths.node_dir(str(tmp_path), j, 0) for j in ids}) == 3
    assert all(_job_id_of(j) == j for j in ids)  # stable when validated again


def test_no_shared_default_job_id(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    alone = ReftConfig().job_id
    assert alone.startswith("local-") and alone == ReftConfig().job_id  # one per process
    # plain torchrun (no --rdzv-id) says "none": the agent, the ranks' parent, names it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    agent = ReftConfig().job_id
    assert agent.startswith("torchrun-") and agent != alone
    assert default_job_id(dict(os.environ))[1] == f"the launching process (pid {os.getppid()})"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")  # --rdzv-id / --standalone's uuid
    assert ReftConfig().job_id == "3f2a"


# ---- --save / --load -----------------------------------------------------------------
@needs_root
def test_load_dir_another_user_can_write_is_refused_by_name(shared):
    from megatron.training.path_checks import checkpoint_dir_error

    ckpt = os.path.join(shared, "ckpt")
    os.mkdir(ckpt, 0o755)
    os.chown(ckpt, NOBODY, NOBODY)  # theirs: they can plant a .metadata pickle
    why = checkpoint_dir_error("--load", ckpt)
    assert why and "\n" not in why and f"belongs to uid {NOBODY}" in why
    assert "--trust-shared-checkpoint-dir" in why
    mine = os.path.join(shared, "mine")
    os.mkdir(mine, 0o777)
    os.chmod(mine, 0o777)
    assert "writable by group or others" in checkpoint_dir_error("--save", mine)
    os.chmod(mine, 0o755)
    assert checkpoint_dir_error("--save", mine) is None
    assert checkpoint_dir_error("--save", os.path.join(mine, "new", "run")) is None
