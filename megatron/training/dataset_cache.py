"""The datasets a process has built, kept for its life, so that a rejoin builds none.

megatron-core's dataset builder is collective: global rank 0 builds (and writes the
index cache), a barrier on the default group, then the other ranks build (reading the
cache). That is right at a job's first start. When the ranks meet again in a new
generation of an in-process restart, the survivors hold their datasets already, a warm
spare may have built them before it had a rank (megatron/training/warm.py), and the
index cache on disk was written at the first start. So in such a generation every rank
builds without collectives (:func:`build` with ``collective=False``): a survivor and a
prepared spare take theirs from here, a replacement that has none builds its own; all
of them make the same (no) collectives, whichever of those they are. At the first start
(``collective=True``) every rank goes through megatron-core's barriers as before, and
what it built is kept for later.

Datasets are a pure function of their config (seed, sequence length, split, sample
counts, data, tokenizer), which is the key; a kept dataset is the same object a rebuild
would make, so the data order, and with it bit-exactness, does not change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types

import torch
from megatron.core.datasets import blended_megatron_dataset_builder as _builder

_kept: dict[str, tuple] = {}
_lock = threading.Lock()


def key(cls, sizes, config) -> str:
    """What the datasets are a function of: the class, the sample counts, every field of
    the config (the tokenizer by its identity: the vocabulary and the files it read)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name != "tokenizer"}
    identity = getattr(config.tokenizer, "identity", None)
    return repr((cls.__module__, cls.__qualname__, list(sizes), sorted(fields.items()),
                 sorted(identity.items()) if isinstance(identity, dict) else identity))


class _LocalTorch:
    """torch as the builder sees it while it builds without collectives: the same
    module, but its distributed package says it is not initialized."""

    distributed = types.SimpleNamespace(is_initialized=lambda: False)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _without_collectives():
    """megatron-core's builder decides on its barriers with
    ``torch.distributed.is_initialized()``; for the length of one build it sees a torch
    whose distributed package says no (only the builder module's view changes; the
    index cache it reads exists since the first start)."""
    with _lock:
        real, _builder.torch = _builder.torch, _LocalTorch()
        try:
            yield
        finally:
            _builder.torch = real


def build(cls, sizes, config, *, collective: bool) -> tuple:
    """(train, valid, test) for ``config``. ``collective``: built through megatron-core's
    barriers whatever this process holds (every rank must make them), and kept.
    Otherwise the kept ones if this process built them before, else built without
    collectives and kept."""
    k = key(cls, sizes, config)
    if not collective and k in _kept:
        return _kept[k]
    maker = _builder.BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config)
    with contextlib.nullcontext() if collective else _without_collectives():
        _kept[k] = tuple(maker.build())
    return _kept[k]


def kept() -> int:
    """How many dataset triples this process holds."""
    return len(_kept)
