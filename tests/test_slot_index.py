"""The device tier's hash index on the CPU (:mod:`hierps.tiers._slot_index`).

- :class:`SlotIndex` answers as a dict does, through growth, moves, removals and keys of any int64 value;
  the compiled loops refuse what would break the index;
- a store trained on demand (no pass announced, a device tier smaller than the rows the loop
  touches, so the tier evicts) ends with exactly the rows, optimizer state and counters of the
  same store indexed by the sorted tensors (the code where the compiled core is missing), plain
  and compact rows alike;
- the compiled dedup of a lookup's ids (``_native.unique_ids``) gives torch.unique's integers, and
  ``locate`` gives found flags only when some key is not held.
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
        held = np.array(list(ref), np.int64)
        gone = np.unique(
            np.concatenate([rng.choice(held, len(held) // 3, replace=False), rng.integers(-8, 8, 4)])
        )
        index.drop(gone)  # keys held removed, keys absent ignored
        for k in gone.tolist():
            ref.pop(k, None)
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


@pytest.mark.parametrize("n", [0, 1, 2, 7, 256, 4097, 70_000])
def test_unique_ids_equal_torch_unique(n):
    rng = np.random.default_rng(n)
    for ids in (
        (rng.zipf(1.3, n) % 1000).astype(np.int64),  # many repeats
        rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),  # all distinct, any sign
        np.resize(np.array([2**63 - 1, -(2**63), 0, -1], np.int64), n),  # the extremes, repeated
    ):
        keys, inverse, counts = _native.unique_ids(ids)
        want = torch.unique(torch.from_numpy(ids), sorted=True, return_inverse=True, return_counts=True)
        assert keys.tolist() == want[0].tolist()
        assert inverse.tolist() == want[1].tolist()
        assert counts.tolist() == want[2].tolist()


def test_unique_ids_refuses_other_buffers():
    with pytest.raises(TypeError, match="int64"):
        _native.unique_ids(np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="as long as ids"):
        _native._core.unique_ids(
            np.arange(4), np.empty(3, np.int64), np.empty(4, np.int64), np.empty(4, np.int64)
        )


def test_lookups_deduplicate_as_torch_unique(monkeypatch):
    from hierps.tiers import _slot_index

    ids = torch.tensor([[5, -3], [5, 9], [2**62, -3]])
    got = _slot_index.distinct_ids(ids)
    monkeypatch.setattr(_slot_index, "NATIVE_UNIQUE_MAX", -1)  # torch.unique serves
    want = _slot_index.distinct_ids(ids)
    assert got[1].shape == ids.shape
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_locate_says_found_only_when_some_key_is_not_held():
    index = SlotIndex(np.array([5, -3, 7]), np.array([4, 1, 2]))
    slots, found = index.locate(np.array([7, 5, 7], np.int64))
    assert found is None and slots.tolist() == [2, 4, 2]
    assert index.locate(np.array([7, 6], np.int64))[1] is not None
    slots, found = index.locate(np.array([], np.int64))
    assert found is None and slots.tolist() == []
    slots, found = index.locate(np.array([7, 6, -3, 6], np.int64))
    assert found.tolist() == [True, False, True, False]
    assert slots[found].tolist() == [2, 1]
    slots, found = index.locate(np.array([-3, -3, 5], np.int64))
    assert found is None and slots.tolist() == [1, 1, 4]


def test_compiled_loops_refuse_a_bad_index():
    with pytest.raises(ValueError, match="power of two"):
        _native.slot_drop(np.zeros(6, np.int64), np.zeros(1, np.int64))
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
    out["stats"] = np.array([store.stats.on_demand_evictions, store.stats.on_demand_rebuilds])
    store.close()
    return out


@pytest.mark.parametrize("weights_dtype", ["fp32", "fp16"])
def test_on_demand_training_equals_the_sorted_index(tmp_path, weights_dtype):
    hashed = _train_on_demand(tmp_path / "hashed", weights_dtype)
    with _native.disabled():
        sorted_ = _train_on_demand(tmp_path / "sorted", weights_dtype)
    assert hashed["stats"][0] > 2  # the tier overflowed and let rows go in place, several times
    for table in ("a", "b"):
        np.testing.assert_array_equal(hashed[table], sorted_[table])
    assert hashed["stats"].tolist() == sorted_["stats"].tolist()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("search_first", [True, False])
def test_a_tables_index_built_late_answers_as_one_kept_up(native, search_first):
    """A device-tier table builds its index (hash on the CPU, sorted keys without the compiled core)
    when a search first needs it; rows added and let go before then, or after, are found as a dict
    of the resident keys says, and a layout that is never searched builds none."""
    from contextlib import nullcontext

    from hierps.tiers._device import _Arena, _Resident

    rng = np.random.default_rng(3)
    with nullcontext() if native else _native.disabled():
        arena = _Arena(4, torch.device("cpu"), 64)
        keys = rng.choice(10_000, 40, replace=False).astype(np.int64)
        table = _Resident(arena, keys, np.arange(40, dtype=np.int64))
        held = dict(zip(keys.tolist(), range(40)))
        assert not table._built
        if search_first:
            table.find(torch.from_numpy(keys[:3]))
            assert table._built
        new = np.setdiff1d(rng.choice(10_000, 30, replace=False), keys).astype(np.int64)
        table.add(new, np.arange(40, 40 + len(new), dtype=np.int64))
        held.update(zip(new.tolist(), range(40, 40 + len(new))))
        gone = np.sort(rng.choice(table.keys, 25, replace=False))
        table.remove(gone, ~np.isin(table.keys, gone))
        for k in gone.tolist():
            del held[k]
        assert table._built == search_first
        ask = np.concatenate([gone, np.array(sorted(held), np.int64), np.array([-5, 20_000], np.int64)])
        found, slots = table.find(torch.from_numpy(ask))
        assert found.tolist() == [k in held for k in ask.tolist()]
        assert slots[found].tolist() == [held[k] for k in ask.tolist() if k in held]
