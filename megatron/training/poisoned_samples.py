"""--poison-train-samples (tests and demos): chosen training samples carry NaN in their
loss mask, as a corrupt sample would, so that a loss spike comes from the data of one
batch and comes back whenever that batch is read again (tests/integration/test_rollback.py:
a rollback must skip it, not train on it twice)."""

from __future__ import annotations

from typing import List, Tuple

import torch


def parse_sample_ranges(text: str) -> List[Tuple[int, int]]:
    """``FIRST-LAST[,...]`` (--poison-train-samples) as [(first, last), ...]."""
    out = []
    for part in text.split(","):
        bits = part.split("-")
        if len(bits) != 2 or not all(b.isdigit() for b in bits) or \
                int(bits[0]) > int(bits[1]):
            raise ValueError(f"expected FIRST-LAST[,...] with FIRST <= LAST, got {part!r}")
        out.append((int(bits[0]), int(bits[1])))
    return out


class PoisonedSamples(torch.utils.data.Dataset):
    """--poison-train-samples (tests): the training samples of ``ranges`` have NaN in
    their loss mask, as a corrupt sample would: whichever iteration reads them, however
    often, its loss and gradients are NaN. The sampler's ids are global sample ids."""

    def __init__(self, dataset, ranges: List[Tuple[int, int]]):
        self.dataset, self.ranges = dataset, ranges

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        item = self.dataset[idx]
        if any(first <= idx <= last for first, last in self.ranges):
            item = dict(item, loss_mask=torch.full_like(item["loss_mask"], float("nan")))
        return item
