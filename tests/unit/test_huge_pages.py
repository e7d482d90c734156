"""The trainer's processes back large tensors with transparent huge pages by default
(pretrain_llama.py, and the warm spare that runs it, set THP_MEM_ALLOC_ENABLE before
torch allocates): a rejoin's first touches and a dead rank's teardown are page-count
bound (docs/nodes.md). A user's THP_MEM_ALLOC_ENABLE=0 is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THP = "/sys/kernel/mm/transparent_hugepage/enabled"

# imports the trainer's entry module the way a rank does (as __main__'s code would run
# its top level), allocates 64 MiB and reports the huge pages backing the process
PROBE = """
import runpy, sys
sys.argv = ["pretrain_llama.py"]
runpy.run_path(sys.argv[1] if len(sys.argv) > 1 else {path!r}, run_name="not_main")
import torch
x = torch.ones(16 << 20)
kb = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHuge")]
print(kb[0])
"""


def _huge_kb(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    code = PROBE.format(path=os.path.join(REPO, "pretrain_llama.py"))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=120,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(),
                    reason="transparent huge pages are off on this machine")
def test_trainer_backs_large_tensors_with_huge_pages_unless_told_not_to():
    assert _huge_kb(None) >= 32 << 10  # most of the 64 MiB
    assert _huge_kb("0") == 0


def test_warm_spare_sets_the_same_default_before_torch_is_imported():
    src = open(os.path.join(REPO, "reft_ext", "cluster", "spare.py")).read()
    main = src[src.index("def main("):]
    assert main.index('setdefault("THP_MEM_ALLOC_ENABLE", "1")') < main.index("import torch")
