"""What a warm spare makes before it has a rank.

reft_ext/cluster/spare.py imports the trainer while it waits for an assignment, and
then calls :func:`prepare` with the training script's arguments (its ``--preload``
names ``megatron.training.warm:prepare``). When the spare is given a rank, the
survivors of the failure wait for it; whatever it made while waiting is off that path.
Only what does not depend on the rank is made here:

* the arguments, parsed and validated as the rank will parse them;
* the tokenizer (megatron/training/tokenizer.py keeps it): its library's import is the
  seconds of a replacement's start-up (``transformers`` for megatron-core's tokenizers,
  2 s of the 2.3 s a crash cost on this host before it moved here);
* the datasets (megatron/training/dataset_cache.py keeps them), only where they live in
  memory (``--mock-data`` without ``--data-cache-path``): an on-disk index cache is
  written by global rank 0 at the job's first start, and a spare started beside it must
  not write the same files;
* then the heap is frozen (``gc.freeze``): torch's, megatron-core's and the tokenizer
  library's millions of objects leave the collector's view, so the rank's collections
  (the in-process restart's own ``gc.collect`` among them) walk what it made itself.

A rank with another layout than the one prepared for builds what it needs as before:
everything kept here is looked up by what it is a function of.
"""

from __future__ import annotations

import gc


def prepare(argv: list[str], world_size: int) -> str:
    """Make what a rank of this job will need whichever rank it is; returns what was
    made (for the spare's log line). Raises what the rank would raise for bad flags."""
    from megatron.training.arguments import parse_args
    from megatron.training.data import build_train_valid_test_datasets
    from megatron.training.tokenizer import build_tokenizer

    args = parse_args(argv, world_size=world_size)
    tokenizer = build_tokenizer(args)
    made = [f"tokenizer {args.tokenizer_type}"]
    if getattr(args, "mock_data", False) and not getattr(args, "data_cache_path", None):
        build_train_valid_test_datasets(args, tokenizer, collective=False)
        made.append("datasets")
    gc.freeze()  # into the permanent generation: later collections skip it
    return ", ".join(made)
