"""Bad input fails early with one line naming the flag; a missing or corrupt --load
fails clearly and leaves every existing checkpoint file untouched."""

import hashlib
import os
import subprocess
import sys

import pytest

from tests.harness.run import REPO, TINY
from megatron.training.arguments import ArgumentError, parse_args

BAD = [
    # (argv, world size, flag named in the error)
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "3"], 3, "--pipeline-model-parallel-size"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--pipeline-model-parallel-size"),
    (["--num-attention-heads", "4", "--num-query-groups", "3", "--hidden-size", "96"], 1,
     "--num-query-groups"),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--num-query-groups", "6",
      "--tensor-model-parallel-size", "4"], 4, "--tensor-model-parallel-size"),
    (["--hidden-size", "100", "--num-attention-heads", "8"], 1, "--num-attention-heads"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "--num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     2, "--num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6", "--micro-batch-size", "2"], 2, "--global-batch-size"),
    (["--sequence-parallel"], 1, "--sequence-parallel"),
    (["--save-interval", "10"], 1, "--save-interval"),
    (["--async-save"], 1, "--async-save"),
    (["--min-lr", "1.0", "--lr", "0.1"], 1, "--min-lr"),
    (["--tokenizer-type", "NullTokenizer"], 1, "--vocab-size"),
    (["--mock-data", "--data-path", "x"], 1, "--mock-data"),
    (["--inject-fault", "7:3"], 4, "--inject-fault"),
    (["--inject-fault", "1:x"], 4, "--inject-fault"),
    (["--inject-fault", "1:3:SIGNOPE"], 4, "--inject-fault"),
    (["--inject-fault", "1:3:KILL:sometimes"], 4, "--inject-fault"),  # unknown mode
    (["--inject-fault", "1:3:KILL:node:x"], 4, "--inject-fault"),  # bad attempt
    (["--inject-fault", "1:0"], 4, "--inject-fault"),  # iteration 0 never runs
    (["--inject-spike", "1:3:huge"], 4, "--inject-spike"),
    (["--inject-spike", "9:3"], 4, "--inject-spike"),
    (["--inject-spike", "1:0:nan"], 4, "--inject-spike"),
    (["--skip-train-batches", "0:2"], 1, "--skip-train-batches"),
    (["--skip-train-batches", "3"], 1, "--skip-train-batches"),
    (["--reft-rollback-on", "always"], 1, "--reft-rollback-on"),
    (["--reft-rollback-on", "spike"], 1, "--reft-rollback-on"),  # needs snapshots
    (["--reft-snapshot-every", "1", "--reft-keep", "1"], 1, "--reft-keep"),
    (["--reft-spike-window", "1"], 1, "--reft-spike-window"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size"),
    (["--train-iters", "5", "--lr-warmup-iters", "5"], 1, "--lr-warmup-iters"),
    # protection without snapshots (the default --reft-snapshot-every 0: REFT off)
    (["--reft-protect", "arc"], 2, "--reft-protect"),
    (["--reft-protect", "aec", "--reft-snapshot-every", "0"], 2, "--reft-protect"),
    # directories that cannot be created (/dev/null is not a directory)
    (["--save", "/dev/null/ckpt"], 1, "--save"),
    (["--reft-snapshot-every", "1", "--reft-flush-dir", "/dev/null/flush"], 1,
     "--reft-flush-dir"),
    (["--data-path", "/nonexistent/corpus_text_document"], 1, "--data-path"),
    (["--data-path", "0.5", "/nonexistent/a", "0.5", "/nonexistent/b"], 1, "--data-path"),
    # ZeRO++: the distributed optimizer's collectives; qwZ needs 16-bit params
    (["--zero-quantized-gradients"], 4, "--zero-quantized-weights/--zero-quantized-gradients"),
    (["--zero-quantized-weights", "--use-distributed-optimizer"], 4,
     "--zero-quantized-weights"),
    (["--zero-gradient-bits", "2"], 4, "--zero-gradient-bits"),
    (["--zero-hpz-partition-size", "3", "--use-distributed-optimizer", "--bf16"], 4,
     "--zero-hpz-partition-size"),
    (["--zero-quantized-gradients", "--use-distributed-optimizer", "--zero-node-size", "3"],
     4, "--zero-node-size"),
]


@pytest.mark.parametrize("argv,world,flag", BAD)
def test_invalid_layout_names_the_flag(argv, world, flag):
    with pytest.raises(ArgumentError) as err:
        parse_args(argv, world_size=world)
    msg = str(err.value)
    assert msg.startswith(flag), msg
    assert "\n" not in msg


def test_valid_layouts_accepted():
    a = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                    "2", "--global-batch-size", "8"], world_size=8)
    assert (a.data_parallel_size, a.num_microbatches) == (2, 2)
    b = parse_args(["--model-size", "llama2-6.7b"], world_size=1)
    assert (b.num_layers, b.hidden_size, b.ffn_hidden_size, b.seq_length) == \
        (32, 4096, 11008, 4096)
    c = parse_args(["--model-size", "llama2-34b"], world_size=1)
    assert (c.num_query_groups, c.ffn_hidden_size) == (8, 22016)


def _main(args, **kw):
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_llama.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180, **kw)


def test_unwritable_directories_fail_at_start_and_leave_nothing(tmp_path):
    """--reft-flush-dir is written only when a worker dies: one that cannot be created
    (/proc takes no directory, even from root) fails before any work, not in the
    watcher's flush; a --save that can be made is probed and left as it was."""
    out = _main(TINY + ["--train-iters", "3", "--reft-snapshot-every", "1",
                        "--reft-flush-dir", "/proc/reft-test/flush"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --reft-flush-dir: cannot create /proc/reft-test/flush (No such file or "
        "directory in /proc); point it at a directory this user can create and write "
        "(default <--save>/reft-flush), or give --reft-flush-dir none to turn "
        "save-on-failure off"], out.stderr[-2000:]
    (tmp_path / "file").write_text("")
    out = _main(TINY + ["--train-iters", "3", "--save", str(tmp_path / "file" / "ckpt")])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: --save: cannot create {tmp_path}/file/ckpt: {tmp_path}/file is not a "
        f"directory; point it at a directory this user can create and write (checkpoints "
        f"are written there)"]
    parse_args(["--save", str(tmp_path / "new" / "ckpt"), "--reft-snapshot-every", "1"])
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the probes left nothing


def test_missing_data_path_is_one_line():
    # (megatron-core's import warnings aside: the data module is imported to check it)
    out = _main(["--train-iters", "2", "--data-path", "/nonexistent/corpus_text_document"],
                env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --data-path: dataset prefix /nonexistent/corpus_text_document: no "
        "/nonexistent/corpus_text_document.bin and no /nonexistent/corpus_text_document.idx; "
        "give PREFIX of existing PREFIX.bin and PREFIX.idx (tools/preprocess_data.py writes "
        "them) or --mock-data"], out.stderr[-2000:]


def test_cli_prints_one_line_and_exits_2():
    out = _main(["--tensor-model-parallel-size", "2"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --tensor-model-parallel-size/--pipeline-model-parallel-size: world size 1 "
        "is not divisible by TP x PP = 2 x 1"]


def _digest(root):
    h = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            h[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return h


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "save")
    out = _main(TINY + ["--train-iters", "3", "--save", root])
    assert out.returncode == 0, out.stderr[-3000:]
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "3"
    return root


def test_load_missing_directory(tmp_path):
    out = _main(TINY + ["--train-iters", "3", "--load", str(tmp_path / "nope")])
    assert out.returncode == 3
    assert f"error: --load {tmp_path / 'nope'}: no such directory" in out.stderr


def test_load_tracker_names_missing_iteration(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    out = _main(TINY + ["--train-iters", "3", "--load", str(tmp_path)])
    assert out.returncode == 3
    assert "names iteration 7" in out.stderr and "iter_0000007" in out.stderr


def test_load_corrupt_checkpoint_fails_clearly_and_touches_nothing(small_checkpoint, tmp_path):
    import shutil

    root = str(tmp_path / "copy")
    shutil.copytree(small_checkpoint, root)
    shard = sorted(p for p in os.listdir(os.path.join(root, "iter_0000003"))
                   if p.endswith(".distcp"))[0]
    path = os.path.join(root, "iter_0000003", shard)
    with open(path, "r+b") as f:  # torn write: the file loses its second half
        f.truncate(os.path.getsize(path) // 2)
    before = _digest(root)
    out = _main(TINY + ["--train-iters", "4", "--load", root, "--save", root])
    assert out.returncode == 3, out.stderr[-2000:]
    # its checksums refuse it before any read (the only checkpoint there: nothing older)
    assert f"error: --load {root}: no checkpoint there verifies (refused: " \
        f"{root}/iter_0000003)" in out.stderr, out.stderr[-2000:]
    assert f"{path}: " in out.stdout + out.stderr  # the refusal names the torn file
    assert _digest(root) == before  # nothing written, nothing deleted


def test_changed_schedule_on_resume_is_refused_without_the_scheduler_flags(small_checkpoint):
    """--train-iters 4 on a checkpoint of a 3-iteration run changes the decay and
    weight-decay horizons: refused before anything is read, naming the flags (Megatron-LM's
    check); --use-checkpoint-opt_param-scheduler resumes with the saved schedule."""
    out = _main(TINY + ["--train-iters", "4", "--load", small_checkpoint])
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: --load {small_checkpoint}/iter_0000003: the learning-rate "
                          f"schedule differs from the one it was saved with (--lr-decay-iters "
                          f"(default --train-iters) 4 here, 3 there; --train-iters 4 here, 3 "
                          f"there)"), err
    assert "--override-opt_param-scheduler" in err and \
        "--use-checkpoint-opt_param-scheduler" in err
    assert "iteration        4/" not in out.stdout
    ok = _main(TINY + ["--train-iters", "4", "--load", small_checkpoint,
                       "--use-checkpoint-opt_param-scheduler"])
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "learning-rate schedule changed (--lr-decay-iters (default --train-iters) 4 " \
           "here, 3 there; --train-iters 4 here, 3 there): the saved values are used " \
           "(--use-checkpoint-opt_param-scheduler)" in ok.stdout
    assert "iteration        4/" in ok.stdout


def test_rerun_of_a_finished_job_says_so_and_trains_nothing(small_checkpoint):
    """The same flags again on the finished checkpoint: one line, nothing trained, no
    recovery counted, no goodput of a run that did not run."""
    out = _main(TINY + ["--train-iters", "3", "--load", small_checkpoint])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "already at --train-iters 3: the loaded state is at it, nothing to train" \
        in out.stdout, out.stdout[-3000:]
    for absent in (" iteration        ", "recoveries:", "goodput"):
        assert absent not in out.stdout, absent


def test_load_with_other_layout_names_the_flag(small_checkpoint):
    out = _main(TINY[:1] + ["2"] + TINY[2:] + ["--train-iters", "4",
                                              "--load", small_checkpoint])
    assert out.returncode == 3
    assert "saved with --num-layers 4, this run has 2" in out.stderr


def _job_shm(job):
    """Every /dev/shm entry of --reft-job-id ``job``, with the files of its directories."""
    out = {}
    parent = os.path.join("/dev/shm", f"reft-{job}")  # the job's private parent
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        p = os.path.join(parent, name)
        out[name] = sorted(os.listdir(p)) if os.path.isdir(p) else None
    return out


@pytest.fixture
def shm_job():
    """A --reft-job-id whose /dev/shm entries are removed afterwards, whatever happened."""
    import shutil
    import uuid

    job = f"refused-{uuid.uuid4().hex[:8]}"
    yield job
    for name in _job_shm(job):
        p = os.path.join("/dev/shm", name)
        shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)


def _other_tp(small_checkpoint, job):
    return TINY + ["--train-iters", "4", "--tensor-model-parallel-size", "2",
                   "--load", small_checkpoint, "--reft-snapshot-every", "1",
                   "--reft-job-id", job]


def test_refused_start_leaves_no_shared_memory(small_checkpoint, shm_job):
    """A start refused after REFT opened its session (a checkpoint of another TP) leaves
    no /dev/shm entry of its job. (The placement check refuses at argument parsing, before
    any session: tests/integration/test_placement_recovery.py.)"""
    from tests.harness.run import torchrun

    refused = torchrun(2, _other_tp(small_checkpoint, shm_job))
    assert refused.returncode != 0
    assert "saved with --tensor-model-parallel-size 1, this run has 2" in refused.output
    assert "iteration        1/" not in refused.output
    assert _job_shm(shm_job) == {}


@pytest.mark.slow  # the release itself is in the default tier (above)
def test_refused_restart_keeps_the_snapshots_there_before(small_checkpoint, shm_job):
    """A refused restart releases only what it allocated: the snapshots of the run
    before it stay for a corrected start to recover from."""
    from tests.harness.run import torchrun

    torchrun(2, TINY + ["--train-iters", "3", "--global-batch-size", "4",
                        "--reft-keep-snapshots", "--reft-snapshot-every", "1",
                        "--reft-job-id", shm_job]).check()
    before = _job_shm(shm_job)
    assert any(f.endswith(".slot0.bin") for f in before["node0"]), before
    again = torchrun(2, _other_tp(small_checkpoint, shm_job))  # another layout's snapshots
    assert again.returncode != 0 and "iteration        1/" not in again.output
    assert _job_shm(shm_job) == before
