"""What a warm spare makes before it has a rank (megatron/training/warm.py), and the
datasets a rejoin takes without collectives (megatron/training/dataset_cache.py).

Each case runs in a process of its own: ``prepare`` freezes the heap (gc.freeze) and
keeps tokenizers and datasets for the life of the process.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--model-size", "tiny", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--train-iters", "7", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1024", "--eval-iters", "0"]

SCRIPT = r"""
import gc, json, sys, torch
from megatron.training import warm
from megatron.training.arguments import parse_args
from megatron.training.data import build_train_valid_test_datasets
from megatron.training.tokenizer import build_tokenizer
from megatron.training import dataset_cache

argv = json.loads(sys.argv[1])
out = {"made": warm.prepare(argv, 4), "frozen": gc.get_freeze_count()}
tok = build_tokenizer(parse_args(argv, world_size=4))
out["kept_datasets"] = dataset_cache.kept()
prepared = next(iter(dataset_cache._kept.values()))
# a rank of the job: a (one-rank) process group exists, so megatron-core's builder
# would barrier; count the barriers each way of building makes
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0,
                                     world_size=1)
barriers = []
real = torch.distributed.barrier
torch.distributed.barrier = lambda *a, **k: (barriers.append(1), real(*a, **k))[1]
args = parse_args(argv, world_size=4)
before = len(barriers)
kept = build_train_valid_test_datasets(args, tok, collective=False)
out["rejoin_barriers"] = len(barriers) - before
before = len(barriers)
fresh = build_train_valid_test_datasets(args, tok, collective=True)
out["first_start_barriers"] = len(barriers) - before
again = build_train_valid_test_datasets(args, tok, collective=False)
out["same_tokenizer"] = tok is build_tokenizer(args)
out["kept_is_prepared"] = kept[0] is not None and all(
    a is b for a, b in zip(kept, prepared))
out["kept_after_first_start"] = all(a is b for a, b in zip(again, fresh))
out["equal_samples"] = all(
    torch.equal(torch.as_tensor(kept[0][i]["tokens"]), torch.as_tensor(fresh[0][i]["tokens"]))
    for i in (0, 1, len(kept[0]) - 1))
# another seed is other data: built anew (without collectives), not the kept one
other = build_train_valid_test_datasets(parse_args(argv + ["--seed", "7"], world_size=4),
                                        tok, collective=False)
out["other_seed_new"] = other[0] is not kept[0] and not torch.equal(
    torch.as_tensor(other[0][0]["tokens"]), torch.as_tensor(kept[0][0]["tokens"]))
torch.distributed.destroy_process_group()
print(json.dumps(out))
"""


def _run(argv):
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argv)], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_prepared_spare_rejoins_with_its_datasets_and_no_collectives():
    out = _run(ARGV)
    assert out["made"] == "tokenizer NullTokenizer, datasets"
    assert out["frozen"] > 10000  # the imports' heap left the collector's view
    assert out["kept_datasets"] == 1 and out["same_tokenizer"]
    # a rejoin takes the prepared datasets and makes no barrier; the first start goes
    # through megatron-core's barriers whatever the process holds; both are the same data
    assert out["rejoin_barriers"] == 0 and out["first_start_barriers"] >= 1
    assert out["kept_is_prepared"] and out["equal_samples"] and out["kept_after_first_start"]
    assert out["other_seed_new"]


def test_a_bad_flag_fails_the_preparation_not_the_spare():
    """``prepare`` raises what the rank would (the spare says it and waits on): argparse
    exits, a layout error raises."""
    code = ("import sys; from megatron.training import warm\n"
            "try:\n    warm.prepare(sys.argv[1:], 3)\n"
            "except (Exception, SystemExit) as e:\n    print(type(e).__name__, e)\n")
    p = subprocess.run([sys.executable, "-c", code, *ARGV], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert "pipeline-model-parallel-size" in p.stdout or "world size" in p.stdout, p.stdout
