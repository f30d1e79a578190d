"""The tiers alone, without a store: the RAM tier over a sink, the device tier's relayout between passes.

- :class:`MemoryTier` caches what it is given and evicts by its policy (LRU by pass, LFU by
  touches), in batches down to 7/8 of its budget; exactly its dirty rows reach the sink, and a
  sink that refuses rows leaves every one of them cached, the error raised to the caller;
- :class:`ResidentKeys` works out a relayout without touching the tier, and
  :meth:`DeviceTier.rebuild` carries one out: rows that stay keep their values and dirty bits,
  only missing keys are fetched, rows that leave come back with their dirty bits;
- :meth:`DeviceTier.evict` (the tier as a cache) lets the least recently used rows go in place,
  never those gathered since the last step or those its caller protects, whose slots stay valid;
  new rows take the freed slots.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hierps.errors import StoreFullError
from hierps.tiers import DeviceTier, MemoryTier, RowSink, SsdTier
from hierps.tiers._device import staged_rows
from hierps.tiers._working_set import ResidentKeys

WIDTH = 2
ROW_BYTES = WIDTH * 4 + 25  # floats + the tier's bookkeeping per row
BUDGET = 10 * ROW_BYTES  # ten rows


class RecordingSink:
    """A sink that keeps copies of what it took, and refuses everything while ``full``."""

    def __init__(self) -> None:
        self.taken: dict[str, dict[int, np.ndarray]] = {}
        self.calls = 0
        self.full = False

    def write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        self.calls += 1
        if self.full:
            raise StoreFullError("no space left on the test sink")
        block = rows if at is None else rows[at]
        assert block.shape == (len(keys), WIDTH)
        for key, row in zip(keys.tolist(), block):
            self.taken.setdefault(table, {})[key] = row.copy()

    def keys(self, table: str = "t") -> set[int]:
        return set(self.taken.get(table, {}))


def rows_of(keys: np.ndarray, salt: float = 0.0) -> np.ndarray:
    """(n, WIDTH) float32 rows telling their key (and version) apart."""
    k = keys.astype(np.float32)
    return np.stack([k + salt, -k - salt], axis=1)


def keys_of(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


@pytest.fixture(autouse=True)
def _evict_to_seven_eighths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAM tier's tests below count rows against an eviction down to 7/8 of the budget (a
    fraction that frees a few rows of a ten-row budget); the fraction the tier runs with is tested
    on its own (:func:`test_eviction_frees_down_to_the_tiers_fraction_of_the_budget`)."""
    monkeypatch.setattr("hierps.tiers._memory._EVICT_TO", 0.875)


def memory(policy: str = "lru") -> tuple[MemoryTier, RecordingSink]:
    sink = RecordingSink()
    tier = MemoryTier(BUDGET, sink, policy)
    tier.add_table("t", WIDTH)
    return tier, sink


def cached(tier: MemoryTier, table: str = "t") -> set[int]:
    keys, _ = tier.columns(table, slice(0, 0))
    return set(keys.tolist())


def test_the_ssd_tier_is_the_sink_the_store_wires(tmp_path):
    ssd = SsdTier(tmp_path / "segments", store_id="test")
    ssd.add_table("t", WIDTH)
    sink: RowSink = ssd
    tier = MemoryTier(BUDGET, sink)
    tier.add_table("t", WIDTH)
    keys = np.arange(15, dtype=np.int64)
    tier.put("t", keys, rows_of(keys))  # 5 rows straight through
    assert ssd.num_rows("t") == 5
    tier.flush()
    found, rows = ssd.read("t", keys)
    assert found.all() and ssd.num_rows("t") == 15
    np.testing.assert_array_equal(rows, rows_of(keys))
    ssd.close()


def test_put_then_get_returns_the_rows_and_counts_hits():
    tier, sink = memory()
    keys = keys_of(3, 8, 20)
    tier.put("t", keys, rows_of(keys), dirty=False)
    hit, rows = tier.get("t", keys_of(1, 3, 8, 9, 20))
    np.testing.assert_array_equal(hit, [False, True, True, False, True])
    np.testing.assert_array_equal(rows, rows_of(keys))
    assert (tier.hits, tier.misses) == (3, 2)
    np.testing.assert_array_equal(tier.contains("t", keys_of(20, 4)), [True, False])
    assert tier.num_rows("t") == 3 and tier.bytes_used == 3 * ROW_BYTES
    assert sink.calls == 0  # nothing left the tier


def test_put_replaces_a_cached_row_and_marks_it_dirty():
    tier, sink = memory()
    keys = keys_of(1, 2)
    tier.put("t", keys, rows_of(keys), dirty=False)
    assert tier.num_dirty("t") == 0
    tier.put("t", keys_of(2), rows_of(keys_of(2), salt=0.5), dirty=True)
    _, rows = tier.get("t", keys)
    np.testing.assert_array_equal(rows, np.stack([rows_of(keys_of(1))[0], rows_of(keys_of(2), salt=0.5)[0]]))
    assert tier.num_dirty("t") == 1 and tier.num_rows("t") == 2


def test_put_of_rows_by_position_caches_what_put_of_those_rows_does():
    """``put(..., at=)`` takes ``rows[at]`` (new rows, cached ones, and a surplus past the budget that
    goes straight to the sink) as a put of those rows themselves would."""
    results = []
    for by_position in (False, True):
        tier, sink = memory()
        tier.put("t", keys_of(1, 3, 5), rows_of(keys_of(1, 3, 5)), dirty=False)
        keys = np.arange(0, 13, dtype=np.int64)  # 13 rows into ten rows' budget: 3 cached, 10 new
        source = rows_of(np.arange(20, dtype=np.int64)[::-1], salt=0.25)  # the rows, in another order
        at = 19 - keys
        if by_position:
            tier.put("t", keys, source, dirty=True, at=at)
        else:
            tier.put("t", keys, source[at], dirty=True)
        held, rows = tier.columns("t", slice(0, WIDTH))
        results.append(
            (held.tolist(), rows.tolist(), {k: v.tolist() for k, v in sink.taken.get("t", {}).items()})
        )
    assert results[0] == results[1]
    held, rows, taken = results[1]
    assert len(held) + len(taken) == 13 and set(held) | set(taken) == set(range(13))
    assert rows == rows_of(np.array(held, np.int64), salt=0.25).tolist()


def _fill_and_touch(tier: MemoryTier) -> None:
    """Keys 0..9 at pass 0; 0, 1, 2 touched five times at pass 0, then 3..9 once at pass 1."""
    keys = np.arange(10, dtype=np.int64)
    tier.put("t", keys, rows_of(keys))
    for _ in range(5):
        tier.get("t", keys_of(0, 1, 2))
    tier.tick = 1
    tier.get("t", np.arange(3, 10, dtype=np.int64))
    assert tier.bytes_used == BUDGET


# One row more than the budget: free it, plus 1/8 of the budget (41 bytes), so 74 bytes: 3 rows.
EVICTED_PER_BATCH = 3


def test_lru_evicts_the_rows_of_the_oldest_pass():
    tier, sink = memory("lru")
    _fill_and_touch(tier)
    tier.put("t", keys_of(10), rows_of(keys_of(10)))
    assert cached(tier) == set(range(3, 11))  # 0, 1, 2 were last used in pass 0
    assert tier.evicted_rows == EVICTED_PER_BATCH
    assert sink.keys() == {0, 1, 2}
    for key in (0, 1, 2):
        np.testing.assert_array_equal(sink.taken["t"][key], rows_of(keys_of(key))[0])


def test_eviction_frees_down_to_the_tiers_fraction_of_the_budget(monkeypatch):
    """One row over a full budget evicts down to the tier's own fraction of it (at most that many
    bytes stay), in one batch: the least recently used rows, every dirty one handed to the sink."""
    from hierps.tiers import _memory

    monkeypatch.undo()  # the fraction the tier runs with, not the fixture's
    budget = 100 * ROW_BYTES
    sink = RecordingSink()
    tier = MemoryTier(budget, sink, "lru")
    tier.add_table("t", WIDTH)
    keys = np.arange(100, dtype=np.int64)
    tier.put("t", keys, rows_of(keys))
    tier.tick = 1
    tier.get("t", keys[50:])  # the first half is the least recently used
    tier.put("t", keys_of(100), rows_of(keys_of(100)))
    kept = int(_memory._EVICT_TO * budget) // ROW_BYTES
    assert tier.bytes_used <= _memory._EVICT_TO * budget + ROW_BYTES
    assert len(cached(tier)) >= kept and 100 in cached(tier)
    assert tier.evicted_rows == 101 - len(cached(tier)) and sink.keys() == set(range(tier.evicted_rows))


def test_a_table_with_few_dirty_rows_to_evict_keeps_them_where_the_others_can_give_the_bytes(monkeypatch):
    """An eviction that would send a table's few dirty rows to the sink (a segment of their own) takes
    the next lowest-scored rows of the other tables instead, as many bytes; where the others cannot
    give them, the table's rows go after all."""
    from hierps.tiers import _memory

    monkeypatch.setattr(_memory, "_FEW_DIRTY_BYTES", 3 * ROW_BYTES)
    sink = RecordingSink()
    tier = MemoryTier(20 * ROW_BYTES, sink, "lru")
    tier.add_table("small", WIDTH)
    tier.add_table("big", WIDTH)
    tier.put("small", keys_of(1, 2), rows_of(keys_of(1, 2)))  # the least recently used rows
    tier.tick = 1
    big = np.arange(100, 118, dtype=np.int64)
    tier.put("big", big, rows_of(big))  # 20 rows: the budget
    tier.tick = 2
    # One row over: evict it and 1/8 of the budget (3.5 rows): 4 rows, which LRU alone would take as
    # small's 2 and big's oldest 2.
    tier.put("big", keys_of(200), rows_of(keys_of(200)))
    assert cached(tier, "small") == {1, 2} and sink.keys("small") == set()
    assert sink.keys("big") == {100, 101, 102, 103} and tier.evicted_rows == 4
    assert tier.bytes_used <= 0.875 * tier.budget + ROW_BYTES

    # The other table cannot give the bytes: the rows go, as few as they are.
    sink = RecordingSink()
    tier = MemoryTier(4 * ROW_BYTES, sink, "lru")
    tier.add_table("small", WIDTH)
    tier.add_table("big", WIDTH)
    tier.put("small", keys_of(1, 2, 3), rows_of(keys_of(1, 2, 3)))
    tier.tick = 1
    tier.put("big", keys_of(100), rows_of(keys_of(100)))
    tier.tick = 2
    tier.put("big", keys_of(200), rows_of(keys_of(200)))  # 1 row over + 0.5 row: 2 rows, big holds 1
    assert sink.keys("small") == {1, 2} and cached(tier, "small") == {3}
    assert cached(tier, "big") == {100, 200}


def test_lfu_evicts_the_least_touched_rows():
    tier, sink = memory("lfu")
    _fill_and_touch(tier)
    tier.put("t", keys_of(10), rows_of(keys_of(10)))
    # 0, 1, 2 were touched six times, 3..9 twice: the first three of those go (ties in key order).
    assert cached(tier) == {0, 1, 2, 6, 7, 8, 9, 10}
    assert sink.keys() == {3, 4, 5}
    assert tier.evicted_rows == EVICTED_PER_BATCH


def test_only_dirty_rows_reach_the_sink_and_exactly_once():
    tier, sink = memory("lru")
    tier.put("t", np.arange(5, dtype=np.int64), rows_of(np.arange(5)), dirty=False)  # e.g. read from SSD
    dirty_keys = np.arange(5, 10, dtype=np.int64)
    tier.put("t", dirty_keys, rows_of(dirty_keys, salt=0.25), dirty=True)
    tier.tick = 1
    tier.get("t", keys_of(0, 3, 4, 6, 7, 8, 9))  # 1, 2 (clean) and 5 (dirty) stay in pass 0
    tier.put("t", keys_of(10), rows_of(keys_of(10)), dirty=False)
    assert cached(tier) == {0, 3, 4, 6, 7, 8, 9, 10}
    assert sink.keys() == {5} and sink.calls == 1
    np.testing.assert_array_equal(sink.taken["t"][5], rows_of(keys_of(5), salt=0.25)[0])
    tier.flush()  # the other dirty rows, once; they stay cached, clean
    assert sink.keys() == set(range(5, 10))
    for key in range(5, 10):
        np.testing.assert_array_equal(sink.taken["t"][key], rows_of(keys_of(key), salt=0.25)[0])
    assert tier.num_dirty("t") == 0 and cached(tier) == {0, 3, 4, 6, 7, 8, 9, 10}
    calls = sink.calls
    tier.flush()
    assert sink.calls == calls  # nothing dirty: nothing written


def test_rows_beyond_an_empty_cache_go_straight_to_the_sink():
    tier, sink = memory()
    keys = np.arange(15, dtype=np.int64)
    tier.put("t", keys, rows_of(keys), dirty=True)
    assert cached(tier) == set(range(10)) and sink.keys() == set(range(10, 15))
    for key in range(10, 15):
        np.testing.assert_array_equal(sink.taken["t"][key], rows_of(keys_of(key))[0])
    clean, clean_sink = memory()
    clean.put("t", keys, rows_of(keys), dirty=False)  # clean rows are in the sink already
    assert cached(clean) == set(range(10)) and clean_sink.calls == 0


def test_a_sink_that_refuses_rows_leaves_them_all_cached_and_raises():
    tier, sink = memory()
    old = np.arange(10, dtype=np.int64)
    tier.put("t", old, rows_of(old))
    sink.full = True
    new = np.arange(10, 14, dtype=np.int64)
    with pytest.raises(StoreFullError):
        tier.put("t", new, rows_of(new, salt=0.5))
    assert sink.taken == {}
    assert cached(tier) == set(range(14))  # over budget, but no row lost
    assert tier.bytes_used > tier.budget and tier.num_dirty("t") == 14 and tier.evicted_rows == 0
    _, rows = tier.get("t", new, touch=False)
    np.testing.assert_array_equal(rows, rows_of(new, salt=0.5))
    with pytest.raises(StoreFullError):
        tier.flush()
    assert tier.num_dirty("t") == 14  # a refused flush leaves the rows dirty
    sink.full = False
    tier.flush()
    assert sink.keys() == set(range(14)) and tier.num_dirty("t") == 0
    np.testing.assert_array_equal(
        np.stack([sink.taken["t"][k] for k in range(10, 14)]), rows_of(new, salt=0.5)
    )


def test_a_refused_surplus_stays_cached_too():
    tier, sink = memory()
    sink.full = True
    keys = np.arange(15, dtype=np.int64)
    with pytest.raises(StoreFullError):
        tier.put("t", keys, rows_of(keys))
    assert cached(tier) == set(range(15)) and tier.num_dirty("t") == 15


def test_the_budget_is_shared_by_tables_and_discard_writes_nothing():
    tier, sink = memory()
    tier.add_table("u", WIDTH)
    tier.put("t", np.arange(6, dtype=np.int64), rows_of(np.arange(6)))
    tier.tick = 1
    tier.put("u", np.arange(6, dtype=np.int64), rows_of(np.arange(6)))  # 12 rows: 2 over, evict 4 of t
    assert tier.bytes_used == 8 * ROW_BYTES
    assert cached(tier, "u") == set(range(6)) and sink.keys("u") == set()
    assert cached(tier, "t") == {4, 5} and sink.keys("t") == {0, 1, 2, 3}
    calls = sink.calls
    tier.discard("u", keys_of(0, 1, 99))
    assert cached(tier, "u") == {2, 3, 4, 5}
    tier.clear()
    assert tier.bytes_used == 0 and sink.calls == calls


# -- the device tier's working set -------------------------------------------------------------
def _device(budget_rows: int = 64) -> DeviceTier:
    tier = DeviceTier(budget_rows * (WIDTH * 4 + 25), torch.device("cpu"))
    tier.add_table("a", WIDTH)
    tier.add_table("b", WIDTH)
    return tier


def _resident(tier: DeviceTier, table: str) -> tuple[np.ndarray, np.ndarray]:
    keys = next(k for t, _, k, _ in tier.resident_keys().tables if t == table)
    found, slots = tier.resolve(table, torch.from_numpy(keys))
    assert bool(found.all())
    return keys, tier.rows(table)[slots].numpy()


class Fetches:
    """A fetch for :meth:`DeviceTier.rebuild` that records what it was asked for."""

    def __init__(self, fail: bool = False) -> None:
        self.asked: list[dict[str, list[int]]] = []
        self.fail = fail

    def __call__(self, requests: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.asked.append({t: k.tolist() for t, k in requests.items()})
        if self.fail:
            raise StoreFullError("no rows today")
        return {t: rows_of(k, salt=100.0) for t, k in requests.items()}


def test_a_relayout_is_worked_out_from_the_resident_keys_alone():
    resident = ResidentKeys(
        7, [("a", 2, keys_of(1, 4, 9), keys_of(5, 3, 8)), ("b", 2, keys_of(2), keys_of(0))]
    )
    relayout = resident.relayout_to({"a": keys_of(1, 2, 9), "b": keys_of(3, 5)})
    assert relayout.version == 7
    assert relayout.first_slot == {"a": 0, "b": 3}  # one arena for width 2: a, then b
    assert {t: k.tolist() for t, k in relayout.missing.items()} == {"a": [2], "b": [3, 5]}
    np.testing.assert_array_equal(relayout.stay_from[2], [5, 8])  # keys 1 and 9 of a
    np.testing.assert_array_equal(relayout.stay_to[2], [0, 2])
    np.testing.assert_array_equal(relayout.new_to[2], [1, 3, 4])
    np.testing.assert_array_equal(relayout.leave_from[2], [3, 0])  # key 4 of a, key 2 of b
    assert [(t, k.tolist()) for t, k in relayout.leave_keys[2]] == [("a", [4]), ("b", [2])]
    assert relayout.capacity == {2: 5}


def test_rebuild_keeps_resident_rows_fetches_the_missing_and_returns_the_leaving():
    tier = _device()
    fetch = Fetches()
    tier.rebuild({"a": keys_of(1, 4, 9), "b": keys_of(2)}, None, fetch)
    assert fetch.asked == [{"a": [1, 4, 9], "b": [2]}]
    # Train key 9 of a: its row changes in the tier and is dirty.
    found, slots = tier.resolve("a", torch.tensor([9]))
    assert bool(found.all())
    tier.rows("a")[slots] += 1.0
    tier.mark_dirty("a", slots)
    version = tier.version
    prepared = {"b": (keys_of(3, 7), rows_of(keys_of(3, 7), salt=50.0))}  # read ahead: 3 but not 5
    drained = tier.rebuild({"a": keys_of(1, 2, 9), "b": keys_of(3, 5)}, prepared, fetch)
    assert fetch.asked[1] == {"a": [2], "b": [5]}  # only what is neither resident nor read ahead
    assert tier.version == version + 1
    keys, rows = _resident(tier, "a")
    np.testing.assert_array_equal(keys, [1, 2, 9])
    np.testing.assert_array_equal(rows, rows_of(keys_of(1, 2, 9), salt=100.0) + [[0, 0], [0, 0], [1, 1]])
    keys, rows = _resident(tier, "b")
    np.testing.assert_array_equal(keys, [3, 5])
    np.testing.assert_array_equal(
        rows, np.stack([rows_of(keys_of(3), 50.0)[0], rows_of(keys_of(5), 100.0)[0]])
    )
    assert sorted(drained) == ["a", "b"]
    np.testing.assert_array_equal(drained["a"].keys, [4])
    np.testing.assert_array_equal(drained["a"].rows, rows_of(keys_of(4), salt=100.0))
    np.testing.assert_array_equal(drained["a"].dirty, [False])
    np.testing.assert_array_equal(drained["b"].keys, [2])
    # Tables lie in key order from the slots layout() gives, and the trained row is still dirty.
    assert tier.layout({"a": 3, "b": 2}) == {"a": 0, "b": 3}
    found, slots = tier.resolve("b", torch.tensor([3, 5]))
    np.testing.assert_array_equal(slots.numpy(), [3, 4])
    dirty = tier.take_dirty()
    assert list(dirty) == ["a"]
    np.testing.assert_array_equal(dirty["a"][0], [9])


@pytest.mark.parametrize("staged", [False, True], ids=["rows", "staged"])
def test_a_relayout_of_arenas_staged_ahead_equals_one_of_the_rows(staged):
    """What the pipeline's worker builds ahead (:meth:`DeviceTier.stage`, the next arenas with the
    rows read ahead in place) gives the tier what a relayout of those rows gives: the same resident
    rows, dirty bits and leaving rows. The leaving rows are copied when first read, after the tier
    has moved on, and are still those that left; the rows read ahead come back out of the arenas."""
    tier = _device()
    tier.rebuild({"a": keys_of(1, 4, 9), "b": keys_of(2, 6)}, None, Fetches())
    found, slots = tier.resolve("a", torch.tensor([9, 4]))
    tier.rows("a")[slots] += torch.tensor([[1.0, 1.0], [2.0, 2.0]])  # train a:9 and a:4
    tier.mark_dirty("a", slots)
    relayout = tier.resident_keys().relayout_to({"a": keys_of(1, 2, 9), "b": keys_of(3, 6)})
    read = {t: rows_of(k, salt=50.0) for t, k in relayout.missing.items()}
    arenas = tier.stage(relayout, read) if staged else None
    if staged:
        assert arenas is not None
        for t, rows in staged_rows(relayout, arenas).items():
            np.testing.assert_array_equal(rows, read[t])
    drained = tier.apply_relayout(relayout, read if not staged else {}, arenas)
    keys, rows = _resident(tier, "a")
    np.testing.assert_array_equal(keys, [1, 2, 9])
    np.testing.assert_array_equal(rows, [[101, -101], [52, -52], [110, -108]])
    keys, rows = _resident(tier, "b")
    np.testing.assert_array_equal(keys, [3, 6])
    np.testing.assert_array_equal(rows, [[53, -53], [106, -106]])
    tier.rebuild({"a": keys_of(4), "b": keys_of(2)}, None, Fetches())  # the tier moves on
    np.testing.assert_array_equal(drained["a"].keys, [4])
    np.testing.assert_array_equal(drained["a"].rows, [[106, -102]])  # as it left, trained
    np.testing.assert_array_equal(drained["a"].dirty, [True])
    np.testing.assert_array_equal(drained["b"].keys, [2])
    np.testing.assert_array_equal(drained["b"].rows, [[102, -102]])
    np.testing.assert_array_equal(drained["b"].dirty, [False])


def test_a_failed_fetch_changes_nothing_and_a_stale_relayout_is_refused():
    tier = _device()
    tier.rebuild({"a": keys_of(1, 2)}, None, Fetches())
    version, generation = tier.version, tier.generation
    before = _resident(tier, "a")
    with pytest.raises(StoreFullError):
        tier.rebuild({"a": keys_of(2, 3)}, None, Fetches(fail=True))
    assert (tier.version, tier.generation) == (version, generation)
    after = _resident(tier, "a")
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    stale = tier.resident_keys().relayout_to({"a": keys_of(1)})
    tier.insert("b", keys_of(4), rows_of(keys_of(4)))  # the tier changes after the relayout was worked out
    with pytest.raises(RuntimeError):
        tier.apply_relayout(stale, {})


@pytest.mark.parametrize("hashed", [True, False], ids=["hash-index", "sorted-index"])
def test_eviction_in_place_lets_the_least_recent_rows_go_and_keeps_the_gathered(monkeypatch, hashed):
    from hierps.tiers import _device

    monkeypatch.setattr(_device, "hashed", lambda: hashed)
    tier = _device.DeviceTier(10 * ROW_BYTES, torch.device("cpu"))
    for t in ("a", "b"):
        tier.add_table(t, WIDTH)
    tier.insert("a", keys_of(1, 2, 3), rows_of(keys_of(1, 2, 3)))  # clock 0
    tier.tick()
    tier.insert("b", keys_of(10, 11), rows_of(keys_of(10, 11)))  # clock 1
    _, a3 = tier.resolve("a", torch.tensor([3]))
    tier.touch("a", a3)
    tier.rows("a")[a3] += 5.0
    tier.mark_dirty("a", a3)
    tier.tick()
    _, b11 = tier.resolve("b", torch.tensor([11]))
    tier.touch("b", b11)  # gathered since the last step: its gradient is pending, it stays
    _, a1 = tier.resolve("a", torch.tensor([1]))
    _, a2 = tier.resolve("a", torch.tensor([2]))
    _, b10 = tier.resolve("b", torch.tensor([10]))
    generation, step_generation = tier.generation, tier.step_generation
    # Rows that may go: a2 (clock 0), a3, b10 (clock 1); a1 is protected by the caller.
    assert tier.evict(10 * ROW_BYTES, 4 * ROW_BYTES, [("a", a1)]) is None  # only 3 may go: nothing changes
    assert tier.generation == generation and tier.bytes_used == 5 * ROW_BYTES
    drained = tier.evict(2 * ROW_BYTES, ROW_BYTES, [("a", a1)])
    # The oldest first (a2); of rows as old, those of a table looked up since the last step (b, not a).
    assert drained is not None and sorted(drained) == ["a", "b"]
    np.testing.assert_array_equal(drained["a"].keys, [2])
    np.testing.assert_array_equal(drained["a"].rows, rows_of(keys_of(2)))
    np.testing.assert_array_equal(drained["b"].keys, [10])
    np.testing.assert_array_equal(drained["b"].dirty, [False])
    assert tier.bytes_used == 3 * ROW_BYTES and tier.num_rows("a") == 2 and tier.num_rows("b") == 1
    # Slots handed out for the rows that stayed hold them still: gathered rows' slots stay valid.
    assert tier.generation != generation and tier.valid(step_generation, touched=True)
    assert not tier.valid(generation, touched=False)
    found, slots = tier.resolve("a", torch.tensor([1, 2, 3]))
    assert found.tolist() == [True, False, True] and slots[0] == a1[0]
    assert tier.resolve("b", torch.tensor([11]))[1].tolist() == b11.tolist()
    # New rows take the freed slots before the arena grows.
    n = tier.arena("a").n
    new = tier.insert("b", keys_of(20, 21, 22), rows_of(keys_of(20, 21, 22)))
    assert sorted(new.tolist()[:2]) == sorted([int(a2[0]), int(b10[0])]) and new.tolist()[2] == n
    assert tier.arena("a").n == n + 1
    keys, rows = _resident(tier, "b")
    np.testing.assert_array_equal(keys, [11, 20, 21, 22])
    np.testing.assert_array_equal(rows, rows_of(keys))
    keys, rows = _resident(tier, "a")
    np.testing.assert_array_equal(keys, [1, 3])
    np.testing.assert_array_equal(rows, rows_of(keys) + [[0, 0], [5, 5]])  # a3 trained, still here


@pytest.mark.parametrize("hashed", [True, False], ids=["hash-index", "sorted-index"])
def test_evictions_inserts_and_steps_in_any_order_keep_every_row_where_its_key_says(monkeypatch, hashed):
    """Three tables over two arenas; random inserts, gathers (touch), row updates, evictions and
    steps. After each operation every resident key resolves to a slot holding its own latest row,
    rows gathered since the last step and protected rows never leave, and each row that leaves comes
    back once with its latest value and dirty bit."""
    from hierps.tiers import _device

    monkeypatch.setattr(_device, "hashed", lambda: hashed)
    widths = {"a": 2, "b": 2, "c": 3}
    tier = _device.DeviceTier(60 * (2 * 4 + 25), torch.device("cpu"))
    for t, w in widths.items():
        tier.add_table(t, w)
    rng = np.random.default_rng(11)
    held: dict[str, dict[int, tuple[np.ndarray, bool]]] = {t: {} for t in widths}  # key -> (row, dirty)
    version = 0.0

    def check() -> None:
        for t, rows in held.items():
            keys = np.array(sorted(rows), np.int64)
            assert tier.num_rows(t) == len(keys)
            if not len(keys):
                continue
            found, slots = tier.resolve(t, torch.from_numpy(keys))
            assert bool(found.all())
            np.testing.assert_array_equal(tier.rows(t)[slots].numpy(), np.stack([rows[k][0] for k in keys]))

    for _ in range(300):
        op = rng.integers(0, 4)
        t = str(rng.choice(list(widths)))
        if op == 0:  # load some absent keys when they fit
            keys = np.unique(rng.integers(0, 80, int(rng.integers(1, 8))))
            keys = keys[~np.isin(keys, list(held[t]))]
            if len(keys) and tier.bytes_used + len(keys) * tier.row_bytes(t) <= tier.budget:
                version += 1
                rows = np.stack([np.full(widths[t], k + version, np.float32) for k in keys])
                tier.insert(t, keys, rows)
                held[t].update({int(k): (r, False) for k, r in zip(keys, rows)})
        elif op == 1 and held[t]:  # a training gather: touch and change some resident rows
            keys = np.array(sorted(rng.choice(list(held[t]), min(3, len(held[t])), replace=False)), np.int64)
            _, slots = tier.resolve(t, torch.from_numpy(keys))
            tier.touch(t, slots)
            tier.rows(t)[slots] += 1.0
            tier.mark_dirty(t, slots)
            held[t].update({int(k): (held[t][int(k)][0] + 1.0, True) for k in keys})
        elif op == 2:  # evict, protecting a few rows of one table
            protect_keys = np.array(sorted(held[t])[:2], np.int64)
            _, protect = tier.resolve(t, torch.from_numpy(protect_keys))
            tier._flush_touched()
            pinned = {
                (u, int(k))
                for u in widths
                for k in held[u]
                if int(tier.arena(u).used[int(tier.resolve(u, torch.tensor([k]))[1][0])]) == tier.clock
            }
            want = int(rng.integers(1, 20)) * 33
            drained = tier.evict(want, min(want, 33), [(t, protect)])
            for u, d in (drained or {}).items():
                for k, row, dirty in zip(d.keys.tolist(), d.rows, d.dirty.tolist()):
                    assert (u, k) not in pinned and not (u == t and k in protect_keys.tolist())
                    np.testing.assert_array_equal(row, held[u][k][0])
                    assert dirty == held[u][k][1]
                    del held[u][k]
        else:
            tier.tick()
        check()


def test_the_ram_tiers_victims_by_counting_scores_are_those_of_a_stable_sort():
    """The rows the RAM tier evicts to free ``nbytes``: the first of a stable sort by score whose
    costs reach it (all if none do), whether the scores are counted (a narrow range) or sorted."""
    from hierps.rows._ids import lowest_scored

    rng = np.random.default_rng(5)
    for scores in (
        rng.integers(0, 7, 5_000),  # LRU clocks: many ties, which go in their order
        rng.integers(3, 900, 2_000),  # with gaps
        rng.integers(-(2**62), 2**62, 300),  # scattered: sorted
        np.array([4]),
    ):
        scores = scores.astype(np.int64)
        costs = rng.choice(np.array([57, 93, 121]), len(scores))
        order = np.argsort(scores, kind="stable")
        total = int(costs.sum())
        for nbytes in (-5, 0, 1, 57, total // 3, total // 2 + 1, total - 1, total, total + 10**6):
            want = np.zeros(len(scores), bool)
            want[order[: int(np.searchsorted(np.cumsum(costs[order]), nbytes)) + 1]] = True
            assert lowest_scored(scores, costs, nbytes).tolist() == want.tolist(), (len(scores), nbytes)
