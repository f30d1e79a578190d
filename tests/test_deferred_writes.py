"""The RAM tier's deferred writes (``MemoryTier.deferred_writes``, used by every write-back): the same
rows stay and leave as without it, the sink gets one batch per table holding each key's last row,
and a sink that refuses a batch loses no row. Rows exact through the SSD tier and after a reopen."""

from __future__ import annotations

import numpy as np
import pytest

from hierps.tiers import MemoryTier, _memory, ram_row_bytes
from hierps.tiers._ssd import SsdTier

WIDTH = 3
TABLES = ("a", "b", "c")


class _Sink:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.writes: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.fail = fail or set()

    def write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        if table in self.fail:
            raise OSError(28, "no space left on the device")
        self.writes.append((table, keys.copy(), (rows if at is None else rows[at]).copy()))

    def newest(self) -> dict[tuple[str, int], np.ndarray]:
        out: dict[tuple[str, int], np.ndarray] = {}
        for table, keys, rows in self.writes:
            out.update({(table, k): r for k, r in zip(keys.tolist(), rows)})
        return out


def _batches(seed: int, rounds: int) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    """Write-backs: per round, for each table, sorted unique keys (overlapping earlier rounds) and rows."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        one = []
        for t in TABLES:
            keys = np.unique(rng.integers(0, 400, int(rng.integers(1, 200)))).astype(np.int64)
            values = np.full((len(keys), WIDTH), r * 1000 + 1, np.float32) + keys[:, None].astype(np.float32)
            one.append((t, keys, values))
        out.append(one)
    return out


def _tier(sink: _Sink, rows: int) -> MemoryTier:
    tier = MemoryTier(rows * ram_row_bytes(WIDTH), sink)
    for t in TABLES:
        tier.add_table(t, WIDTH)
    return tier


def _cached(tier: MemoryTier) -> dict[tuple[str, int], np.ndarray]:
    out = {}
    for t in TABLES:
        keys, rows = tier.columns(t, slice(None))
        out.update({(t, k): r for k, r in zip(keys.tolist(), rows)})
    return out


def _write_backs(
    tier: MemoryTier, batches: list[list[tuple[str, np.ndarray, np.ndarray]]]
) -> dict[tuple[str, int], np.ndarray]:
    """Put each batch as a write-back does (deferred writes, its own clock); the newest row of every key."""
    expected: dict[tuple[str, int], np.ndarray] = {}
    for p, batch in enumerate(batches):
        tier.tick = p
        with tier.deferred_writes():
            for t, keys, values in batch:
                tier.put(t, keys, values)
        for t, keys, values in batch:
            expected.update({(t, k): r for k, r in zip(keys.tolist(), values)})
    return expected


def _same(x: dict[tuple[str, int], np.ndarray], y: dict[tuple[str, int], np.ndarray]) -> bool:
    return x.keys() == y.keys() and all(np.array_equal(x[k].view(np.uint32), y[k].view(np.uint32)) for k in x)


@pytest.mark.parametrize(("rows", "held_bytes"), [(40, None), (150, None), (500, None), (150, 2000)])
def test_deferred_writes_keep_and_hand_down_what_direct_writes_do(rows, held_bytes, monkeypatch):
    if held_bytes is not None:  # rows held go down in several batches
        monkeypatch.setattr(_memory, "_HELD_BYTES", held_bytes)
    # Evicting down to 7/8 of the budget, the tables' puts of one write-back evict several times
    # (whatever the fraction, deferred and direct writes keep the same rows).
    monkeypatch.setattr(_memory, "_EVICT_TO", 0.875)
    direct, deferred = _Sink(), _Sink()
    plain, held = _tier(direct, rows), _tier(deferred, rows)
    for p, batch in enumerate(_batches(0, 12)):
        plain.tick = held.tick = p
        for t, keys, values in batch:
            plain.put(t, keys, values)
        writes_before = len(deferred.writes)
        with held.deferred_writes():
            for t, keys, values in batch:
                held.put(t, keys, values)
            # Nothing reaches the sink before the end (unless more is held than it holds back).
            assert held_bytes is not None or len(deferred.writes) == writes_before
        tables = [t for t, _, _ in deferred.writes[writes_before:]]
        assert held_bytes is not None or len(tables) == len(set(tables))  # one batch per table
        for _, keys, _ in deferred.writes[writes_before:]:
            assert np.all(keys[1:] > keys[:-1])
        # The same rows cached, and below them the same newest row of every key.
        assert _same(_cached(plain), _cached(held))
        assert _same(direct.newest(), deferred.newest())
    assert len(deferred.writes) < len(direct.writes)


def test_a_refused_batch_stays_in_ram_and_the_others_go_down():
    sink = _Sink()
    tier = _tier(sink, 60)
    batches = _batches(1, 6)
    expected = _write_backs(tier, batches[:-1])
    sink.fail = {"b"}
    tier.tick = len(batches)
    with pytest.raises(OSError), tier.deferred_writes():
        for t, keys, values in batches[-1]:
            tier.put(t, keys, values)
    for t, keys, values in batches[-1]:
        expected.update({(t, k): r for k, r in zip(keys.tolist(), values)})
    # Every row is in RAM (the refused ones, dirty) or below it: none lost, each the newest.
    visible = {**sink.newest(), **_cached(tier)}
    assert _same(visible, expected)
    assert tier.num_dirty("b") > 0
    sink.fail = set()
    tier.flush()
    assert _same(sink.newest(), expected)


def test_rows_exact_through_the_ssd_tier_and_after_a_reopen(tmp_path):
    ssd = SsdTier(tmp_path, max_segments=3, store_id="test")
    for t in TABLES:
        ssd.add_table(t, WIDTH)
    ssd.collect_garbage(set())
    tier = MemoryTier(50 * ram_row_bytes(WIDTH), ssd)
    for t in TABLES:
        tier.add_table(t, WIDTH)
    expected = _write_backs(tier, _batches(2, 10))
    tier.flush()
    recorded = {t: ssd.live_set(t) for t in TABLES}
    ssd.close()
    fresh = SsdTier(tmp_path, max_segments=3, store_id="test")
    for t in TABLES:
        fresh.load_segments(t, WIDTH, recorded[t])
    for t in TABLES:
        keys = np.array(sorted(k for tt, k in expected if tt == t), np.int64)
        found, rows = fresh.read(t, keys)
        assert found.all() and fresh.num_rows(t) == len(keys)
        want = np.stack([expected[(t, k)] for k in keys.tolist()])
        assert np.array_equal(rows.view(np.uint32), want.view(np.uint32))
    fresh.close()


def test_a_written_segment_holds_what_its_files_hold(tmp_path):
    """A write-back's segment keeps the fences and filter its writer wrote (no read at its first lookup):
    the same as those read back from its files."""
    ssd = SsdTier(tmp_path, store_id="test")
    ssd.add_table("a", WIDTH)
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-(10**12), 10**12, 5000)).astype(np.int64)
    ssd.write("a", keys, rng.standard_normal((len(keys), WIDTH)).astype(np.float32))
    (seg,) = ssd._segs["a"].values()
    assert seg.ram_bytes > 0  # held from the write, before any lookup
    held, last = seg._load(), seg._last
    seg.unload()
    read = seg._load()
    assert all(np.array_equal(x, y) for x, y in zip(held, read)) and seg._last == last == int(keys[-1])
    found, _ = ssd.read("a", keys)
    assert found.all()
    ssd.close()
