"""Dataset cache and lock files are private to the training user (issue 30, findings 1 and 6).

megatron-core loads the cached index files with np.load(allow_pickle=True): whoever can write the
cache directory can run code as the training user. The old default cache was a fixed name in the
shared temp dir ($TMPDIR/megatron_data_cache_<uid>) and the locks were
$TMPDIR/megatron_data_<uid>_<name>.lock opened with open(path, "w") (following symlinks). These
tests use real directories, real ownership (chown / setpriv as user nobody) and real datasets.
"""

import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from megatron.training import data as data_mod
from megatron.training import data_cache_dir
from megatron.training.data import build_train_valid_test_datasets
from megatron.training.data_cache_dir import UnsafeCacheDirError, private_dir
from megatron.training.dataset_files import ensure_preprocessed
from megatron.training.tokenizer import build_tokenizer
from tests.unit.test_data import make_args, write_jsonl

NOBODY = 65534
IS_ROOT = os.geteuid() == 0
SETPRIV = shutil.which("setpriv")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another uid needs root")
needs_setpriv = pytest.mark.skipif(
    not (IS_ROOT and SETPRIV),
    reason="acting as user nobody needs root and setpriv (util-linux)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("seccorpus")
    texts = [f"doc {i}: " + " ".join(f"w{(i * 5 + j) % 89}" for j in range(5 + i % 30)) + "\n"
             for i in range(200)]
    write_jsonl(d / "tiny.jsonl", texts)
    with pytest.MonkeyPatch.context() as mp:  # locks of this fixture: not in the real ~/.cache
        mp.setenv("XDG_CACHE_HOME", str(d / "xdg"))
        return ensure_preprocessed(str(d / "tiny.jsonl"))


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    """A private XDG cache home for this test: the new default cache root lives below it."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


@pytest.fixture
def shared_tmp(monkeypatch):
    """A world-writable sticky temp dir (like /tmp) that user nobody can reach, used as
    $TMPDIR / tempfile.gettempdir() for the test."""
    d = tempfile.mkdtemp(prefix="reft-sec-", dir="/tmp")
    os.chmod(d, 0o1777)
    monkeypatch.setenv("TMPDIR", d)
    monkeypatch.setattr(tempfile, "tempdir", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def build(args):
    return build_train_valid_test_datasets(args, build_tokenizer(args))


def refused(args, path, *words):
    with pytest.raises(UnsafeCacheDirError) as e:
        build(args)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def tree(path):
    return sorted(os.path.relpath(os.path.join(r, f), path)
                  for r, ds, fs in os.walk(path) for f in fs + ds)


# --- (a) a given cache directory is checked -------------------------------------------------
@needs_root
def test_cache_dir_owned_by_another_uid_is_refused(corpus, xdg, tmp_path):
    cache = tmp_path / "foreign"
    cache.mkdir(mode=0o700)
    os.chown(cache, NOBODY, NOBODY)
    refused(make_args(data_path=[corpus], data_cache_path=str(cache)), cache,
            f"belongs to uid {NOBODY}", "--data-cache-path")
    assert os.listdir(cache) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_group_or_world_writable_cache_dir_is_refused(corpus, xdg, tmp_path, mode):
    cache = tmp_path / "open"
    cache.mkdir()
    os.chmod(cache, mode)
    refused(make_args(data_path=[corpus], data_cache_path=str(cache)), cache,
            f"mode {mode:04o}", f"chmod 700 {cache}")
    assert os.listdir(cache) == []


def test_symlinked_cache_dir_is_refused(corpus, xdg, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    refused(make_args(data_path=[corpus], data_cache_path=str(link)), link, "symbolic link")
    assert os.listdir(real) == []


def test_mock_data_cache_dir_is_checked_too(xdg, tmp_path):
    cache = tmp_path / "mock"
    cache.mkdir()
    os.chmod(cache, 0o777)
    refused(make_args(mock_data=True, split="969,30,1", data_cache_path=str(cache)), cache,
            "writable by group or others")


def test_private_cache_dir_is_created_0700_and_used(corpus, xdg, tmp_path):
    cache = tmp_path / "new" / "cache"
    train, _, _ = build(make_args(data_path=[corpus], data_cache_path=str(cache)))
    assert len(train) > 0
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (fp_dir,) = list(cache.iterdir())
    assert stat.S_IMODE(fp_dir.stat().st_mode) == 0o700
    assert any(p.suffix == ".npy" for p in fp_dir.iterdir())
    # A second build (loads the cache) passes the same checks.
    assert len(build(make_args(data_path=[corpus], data_cache_path=str(cache)))[0]) == len(train)


def test_private_dir_accepts_0755_owned_dir(tmp_path):
    d = tmp_path / "ro-for-others"
    d.mkdir()
    os.chmod(d, 0o755)
    assert private_dir(str(d)) == str(d)


# --- (b) the attack, re-tried: user nobody plants the old default cache directory -----------
@needs_setpriv
def test_planted_old_default_cache_dir_is_not_used(corpus, xdg, shared_tmp):
    old = os.path.join(shared_tmp, f"megatron_data_cache_{os.getuid()}")
    subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                    "sh", "-c", 'mkdir "$1" && chmod 777 "$1"', "sh", old], check=True)
    st = os.stat(old)
    assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o777
    assert tempfile.gettempdir() == shared_tmp  # the old code would have picked `old`

    # Default settings: the cache is the user's own, and the planted directory stays untouched.
    train, _, _ = build(make_args(data_path=[corpus]))
    assert len(train) > 0
    root = xdg / "reft-megatron" / "data-cache"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.getuid()
    fps = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert len(fps) == 1 and any(p.suffix == ".npy" for p in fps[0].iterdir())
    assert os.listdir(old) == []
    assert os.stat(old).st_mtime_ns == st.st_mtime_ns
    assert not any(n.startswith("megatron_data_") and n.endswith(".lock")
                   for n in os.listdir(shared_tmp))

    # Pointing the cache flag at it: the start is refused, naming it.
    refused(make_args(data_path=[corpus], data_cache_path=old), old, f"belongs to uid {NOBODY}")
    assert os.listdir(old) == []


@needs_setpriv
def test_planted_default_cache_root_is_refused(corpus, tmp_path, monkeypatch):
    """Even the new default root is checked: an XDG_CACHE_HOME in a shared place where another
    user created reft-megatron/data-cache first is refused, not used."""
    shared = tempfile.mkdtemp(prefix="reft-sec-xdg-", dir="/tmp")
    try:
        os.chmod(shared, 0o1777)
        root = os.path.join(shared, "reft-megatron", "data-cache")
        subprocess.run([SETPRIV, "--reuid", str(NOBODY), "--regid", str(NOBODY),
                        "--clear-groups", "sh", "-c", 'mkdir -p "$1" && chmod 777 "$1"', "sh",
                        root], check=True)
        monkeypatch.setenv("XDG_CACHE_HOME", shared)
        refused(make_args(data_path=[corpus]), root, f"uid {NOBODY}")
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# --- (c) lock files never follow a planted symlink ------------------------------------------
def test_planted_symlink_at_old_lock_path_is_not_followed(xdg, shared_tmp, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    before = victim.stat()
    src = tmp_path / "c2.jsonl"
    write_jsonl(src, ["some text\n", "more text\n"])
    prefix = str(tmp_path / "c2_text_document")
    import hashlib
    key = hashlib.sha1(os.path.abspath(prefix).encode()).hexdigest()[:16]
    planted = [os.path.join(shared_tmp, f"megatron_data_{os.getuid()}_{n}.lock")
               for n in ("helpers_cpp", f"preprocess_{key}")]
    for p in planted:
        os.symlink(victim, p)

    data_mod.ensure_dataset_helpers()
    with data_cache_dir._file_lock("helpers_cpp"):
        pass
    assert ensure_preprocessed(str(src)) == prefix  # takes the preprocess lock

    assert victim.read_text() == "precious\n"
    assert victim.stat().st_mtime_ns == before.st_mtime_ns
    assert all(os.path.islink(p) for p in planted)
    locks = xdg / "reft-megatron" / "data-cache" / ".locks"
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700
    assert stat.S_IMODE(locks.parent.stat().st_mode) == 0o700
    for n in ("helpers_cpp", f"preprocess_{key}"):
        f = locks / f"megatron_data_{n}.lock"
        assert f.is_file() and not f.is_symlink()
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_symlink_inside_lock_dir_is_refused_not_followed(xdg, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    with data_cache_dir._file_lock("probe"):
        pass
    locks = xdg / "reft-megatron" / "data-cache" / ".locks"
    (locks / "megatron_data_planted.lock").symlink_to(victim)
    with pytest.raises(UnsafeCacheDirError, match="symlink"):
        with data_cache_dir._file_lock("planted"):
            pass
    assert victim.read_text() == "precious\n"


@needs_root
def test_foreign_owned_lock_dir_is_refused(xdg):
    with data_cache_dir._file_lock("probe"):
        pass
    locks = xdg / "reft-megatron" / "data-cache" / ".locks"
    os.chown(locks, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDirError, match=f"lock directory {locks}"):
        with data_cache_dir._file_lock("probe"):
            pass


def test_data_cache_path_error_for_argument_validation(xdg, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    os.chmod(bad, 0o777)
    msg = data_cache_dir.data_cache_path_error(str(bad))
    assert msg and "\n" not in msg and str(bad) in msg and f"chmod 700 {bad}" in msg
    assert data_cache_dir.data_cache_path_error(str(tmp_path / "good")) is None
    assert data_cache_dir.data_cache_path_error(None) is None  # the default root, created 0700
    assert stat.S_IMODE((xdg / "reft-megatron" / "data-cache").stat().st_mode) == 0o700
