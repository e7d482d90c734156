"""A manifest is sealed with one sorted dump (reft_ext/store/slots.py ``sealed``, issue 57)
and still reads back whole after any JSON round trip; long int sequences (Python's RNG
state) are packed as bytes and come back as the same Python values."""

from __future__ import annotations

import enum
import json
import random

import numpy as np
import pytest
import torch

from reft_ext.store.slots import SEAL, from_jsonable, read_sealed, sealed, to_jsonable


class _Key(str, enum.Enum):
    OWN = "own"


CASES = [
    {},
    {"slot": 1, "iteration": 5},
    {"a": {2: "int keys sort as numbers before they become strings", 10: 1}, "b": (1, 2.5)},
    {"x": float("nan"), "y": [float("inf"), 1e-300, {"k": (3, "\u00e9\u2028")}]},
    {_Key.OWN: [1, 2], "regions": {_Key.OWN: [0, 8, 123]}},
    {"meta": to_jsonable({"rng": random.getstate(), "t": torch.arange(5),
                          "n": np.arange(3, dtype=np.uint32)})},
]


@pytest.mark.parametrize("obj", CASES)
def test_a_sealed_manifest_reads_back_whole(tmp_path, obj):
    path = tmp_path / "m.json"
    path.write_text(sealed(obj))
    got, why = read_sealed(str(path))
    assert why is None, why
    assert json.dumps(got, sort_keys=True) == json.dumps(json.loads(json.dumps(obj)),
                                                         sort_keys=True)
    # one byte of the content changed: the seal no longer matches
    text = path.read_text()
    assert text.rstrip().endswith("}") and f'"{SEAL}"' in text
    path.write_text(text.replace('"', "'", 1) if not obj else text.replace(":", ": ", 1)
                    .replace("1", "2", 1))
    assert read_sealed(str(path))[0] is None


@pytest.mark.parametrize("seq", [
    random.getstate()[1],              # 625 ints, a tuple
    list(range(-40, 40)),
    [2 ** 63 - 1, -2 ** 63] * 40,
    [2 ** 64] + list(range(70)),       # beyond 64 bits: kept as numbers
    [True] + list(range(70)),          # a bool is not packed as an int
])
def test_long_int_sequences_come_back_as_the_same_values(seq):
    enc = json.loads(json.dumps(to_jsonable(seq)))
    back = from_jsonable(enc)
    assert back == seq and type(back) is type(seq)
    assert [type(x) for x in back] == [type(x) for x in seq]
    packed = "__int64__" in enc
    assert packed == (all(type(x) is int and -2 ** 63 <= x < 2 ** 63 for x in seq))


def test_pythons_rng_state_restores_the_same_stream():
    state = random.getstate()
    want = [random.random() for _ in range(3)]
    random.setstate(from_jsonable(json.loads(json.dumps(to_jsonable(state)))))
    assert [random.random() for _ in range(3)] == want
