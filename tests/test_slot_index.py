"""The device tier's hash index on the CPU (:mod:`hierps.tiers._slot_index`).

- :class:`SlotIndex` answers as a dict does, through growth, moves and keys of any int64 value;
  the compiled loops refuse what would break the index;
- a store trained on demand (no pass announced, a device tier smaller than the rows the loop
  touches, so the tier evicts) ends with exactly the rows, optimizer state and counters of the
  same store indexed by the sorted tensors (the code where the compiled core is missing), plain
  and compact rows alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hierps
from hierps.storage import _native
from hierps.tiers._slot_index import SlotIndex

pytestmark = pytest.mark.skipif(not _native.enabled(), reason="the compiled core is not built")


def test_slot_index_answers_as_a_dict():
    rng = np.random.default_rng(0)
    index, ref = SlotIndex(), {}
    for _ in range(120):
        keys = np.unique(
            np.concatenate(
                [rng.integers(-(2**63), 2**63 - 1, size=int(rng.integers(0, 400))), rng.integers(-4, 4, 3)]
            )
        )
        slots = rng.integers(0, 10**9, size=len(keys))
        index.put(keys, slots)  # new keys added, keys held moved
        ref.update(zip(keys.tolist(), slots.tolist()))
        asked = np.concatenate([keys, rng.integers(-8, 8, 16), [-(2**63), 2**63 - 1]])
        found, got = index.find(asked)
        want = [ref.get(k) for k in asked.tolist()]
        assert found.tolist() == [w is not None for w in want]
        assert got.tolist() == [w if w is not None else 0 for w in want]
    assert index.n == len(ref)
    assert 4 * index.n <= 2 * index.capacity  # at most half full


def test_slot_index_from_arrays_and_empty():
    index = SlotIndex(np.array([5, -3, 7]), np.array([0, 1, 2]))
    assert index.find(np.array([7, 5, -3, 4]))[1].tolist() == [2, 0, 1, 0]
    found, slots = SlotIndex().find(np.array([1, 2], np.int64))
    assert not found.any() and slots.tolist() == [0, 0]


def test_compiled_loops_refuse_a_bad_index():
    with pytest.raises(ValueError, match="power of two"):
        _native.slot_find(
            np.zeros(6, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, bool)
        )
    with pytest.raises(ValueError, match="half full"):
        _native.slot_put(np.zeros(4, np.int64), 1, np.array([1, 2], np.int64), np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match=">= 0"):
        _native.slot_put(np.zeros(16, np.int64), 0, np.array([1], np.int64), np.array([-1], np.int64))
    with pytest.raises(ValueError, match="one slot and one bool"):
        _native.slot_find(
            np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(2, bool)
        )


def _train_on_demand(path, weights_dtype: str) -> dict[str, np.ndarray]:
    """Two tables, power-law ids, 40 steps through the modules in a plain loop: no pass announced."""
    store = hierps.Store(path, memory_budget="64MiB", device_budget=6_000, seed=3)
    optimizer = {"type": "adagrad", "params": {"lr": 0.1}}
    a = hierps.EmbeddingBag(
        None, 8, mode="sum", store=store, name="a", optimizer=optimizer, weights_dtype=weights_dtype
    )
    b = hierps.Embedding(None, 4, store=store, name="b", optimizer={"type": "sgd", "params": {"lr": 0.5}})
    rng = np.random.default_rng(1)
    for _ in range(40):
        ids_a = torch.from_numpy((rng.zipf(1.3, 24) % 500).astype(np.int64) - 100)
        offsets = torch.tensor([0, 5, 9, 16, 20])
        ids_b = torch.from_numpy((rng.zipf(1.5, (5, 2)) % 300).astype(np.int64))
        loss = a(ids_a, offsets).pow(2).sum() + b(ids_b).sum()
        loss.backward()
        store.step()
    keys = {t: np.arange(-100, 500) for t in ("a", "b")}
    out = {t: store.read_rows(t, k) for t, k in keys.items()}
    out["stats"] = np.array([store.stats.on_demand_rebuilds])
    store.close()
    return out


@pytest.mark.parametrize("weights_dtype", ["fp32", "fp16"])
def test_on_demand_training_equals_the_sorted_index(tmp_path, weights_dtype):
    hashed = _train_on_demand(tmp_path / "hashed", weights_dtype)
    with _native.disabled():
        sorted_ = _train_on_demand(tmp_path / "sorted", weights_dtype)
    assert hashed["stats"][0] > 2  # the tier overflowed and evicted, several times
    for table in ("a", "b"):
        np.testing.assert_array_equal(hashed[table], sorted_[table])
    assert hashed["stats"][0] == sorted_["stats"][0]
