"""The SSD tier as an LSM tree of sorted runs, against a dict: after every operation (writes,
writes that compact, deletes, compactions, forced rewrites) every read, scan and count equals the
dict's, the tier's bounds hold (segments, rows stored per live row, directories on disk), what a
checkpoint records reloads, protected segments survive compaction; a store trained on demand keeps
its disk bounded and equals plain torch; and a store of format version 2 is refused."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from zarr.storage import LocalStore

import hierps
from hierps._store import store_parts
from hierps.storage import FORMAT_VERSION
from hierps.storage._files import OpenFiles, write_json_atomic
from hierps.storage._merge import merged, merged_sources
from hierps.storage._segment import Segment, SegmentWriter, chunk_rows_for, segment_name
from hierps.tiers import _ssd
from hierps.tiers._ssd import SsdTier

T, U = "t", "u"  # the table under test; a second table that must not be disturbed by it
U_WIDTH = 3
I64 = np.iinfo(np.int64)
# Keys whose two float32 halves are NaNs (quiet and signalling, with payloads), infinities,
# negative zero, subnormals: a segment stores keys in float32 columns and must keep them bit for bit.
SPECIAL_KEYS = np.array(
    [
        I64.min,
        I64.min + 1,
        I64.max,
        I64.max - 1,
        -1,
        -2,
        0,
        1,
        -(1 << 31),
        1 << 31,
        0x7F800001,  # signalling NaN in the low half
        0x7FC00001,
        0x7F800000,
        0xFF800001,
        0x80000000,
        0x00000001,
        0x7F800001 << 32,
        (0x7F800001 << 32) | 0x7FA00000,
        (0x7FBFFFFF << 32) | 0xFFC00001,
        -(0x00800001 << 32),
        1 << 62,
        -(1 << 62),
    ],
    np.int64,
)


def _bits(rows: np.ndarray) -> np.ndarray:
    """float32 rows as their bits: NaNs and -0.0 compare exactly."""
    return np.ascontiguousarray(rows, np.float32).view(np.uint32)


def _key_pool(rng: np.random.Generator) -> np.ndarray:
    """Keys writes draw from: a dense range (many overwrites), huge and negative keys, special keys."""
    huge = rng.integers(I64.min, I64.max, size=400, dtype=np.int64, endpoint=True)
    return np.unique(np.concatenate([np.arange(-200, 2800, dtype=np.int64), huge, SPECIAL_KEYS]))


def _dirs_on_disk(root: Path, table: str) -> set[int]:
    tdir = root / table
    return {int(p.name) for p in tdir.iterdir() if p.is_dir()} if tdir.exists() else set()


class Model:
    """An :class:`SsdTier` and the dict it must equal, driven by random operations."""

    def __init__(self, root: Path, width: int, rng: np.random.Generator, max_segments: int = 3) -> None:
        self.root, self.width, self.rng = root, width, rng
        self.pool = _key_pool(rng)
        self.oracle: dict[int, np.ndarray] = {}
        self.tier = self._open(max_segments)
        # A second table, written once: nothing done to T may change it.
        self.u_keys = np.sort(rng.choice(self.pool, 300, replace=False))
        self.u_rows = rng.standard_normal((300, U_WIDTH)).astype(np.float32)
        self.tier.write(U, self.u_keys, self.u_rows)
        self.ops: list[str] = []

    def _open(self, max_segments: int) -> SsdTier:
        tier = SsdTier(self.root, max_segments=max_segments, store_id="test")
        tier.add_table(T, self.width)
        tier.add_table(U, U_WIDTH)
        tier.collect_garbage(set())  # nothing protected: every retired segment is deleted at once
        return tier

    # -- operations -----------------------------------------------------------------------------
    def random_rows(self, n: int) -> np.ndarray:
        rows = self.rng.standard_normal((n, self.width)).astype(np.float32)
        if n and self.rng.random() < 0.3:  # odd float values in the rows too
            odd = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32)
            at = self.rng.integers(0, rows.size, size=min(rows.size, 20))
            rows.reshape(-1)[at] = self.rng.choice(odd, len(at))
        return rows

    def write(self, size: int | None = None) -> None:
        n = size if size is not None else int(self.rng.choice([0, 1, 2, 17, 60, 300, 900, 2500]))
        n = int(min(n, len(self.pool)))
        if self.rng.random() < 0.5 and self.oracle:  # mostly overwrites
            present = np.fromiter(self.oracle, np.int64)
            k = min(len(present), n // 2)
            keys = np.unique(
                np.concatenate([self.rng.choice(present, k, replace=False), self.rng.choice(self.pool, n)])
            )
            keys = self.rng.permutation(keys)[:n]
        else:
            keys = self.rng.choice(self.pool, n, replace=False)  # random order
        if self.rng.random() < 0.2:
            keys = np.sort(keys)
        n = len(keys)
        if self.rng.random() < 0.3:  # rows given as a gather of a larger array
            big = self.random_rows(n + 50)
            at = self.rng.permutation(n + 50)[:n].astype(np.int64)
            self.tier.write(T, keys, big, at=at)
            rows = big[at]
        else:
            rows = self.random_rows(n)
            self.tier.write(T, keys, rows)
        self.oracle.update(zip(keys.tolist(), rows.copy()))
        self.ops.append(f"write({n})")

    def delete(self) -> None:
        present = np.fromiter(self.oracle, np.int64, len(self.oracle))
        k = int(self.rng.integers(0, min(len(present), 400) + 1))
        absent = self.rng.integers(I64.min, I64.max, size=int(self.rng.integers(0, 30)), dtype=np.int64)
        keys = np.concatenate(
            [self.rng.choice(present, k, replace=False), absent, self.rng.choice(self.pool, 20)]
        )
        keys = self.rng.permutation(np.concatenate([keys, keys[:5]]))  # unsorted, with repeats
        had = {int(x) for x in keys if int(x) in self.oracle}
        assert self.tier.delete(T, keys) == len(had)
        for x in had:
            del self.oracle[x]
        self.ops.append(f"delete({len(keys)}, had {len(had)})")

    def compact(self) -> None:
        k = int(self.rng.integers(2, 6))
        self.tier.compact(T, max_segments=k)
        self.ops.append(f"compact(max_segments={k})")

    def rewrite(self) -> None:
        live = [s for _, s in self.tier.segments(T)]
        if not live:
            return
        chosen = sorted(
            self.rng.choice(live, int(self.rng.integers(1, len(live) + 1)), replace=False).tolist()
        )
        before = self.tier.num_rows(T)
        written = self.tier.compact(T, rewrite=chosen)
        self.ops.append(f"compact(rewrite={chosen}) -> {written}")
        left = {s for _, s in self.tier.segments(T)}
        assert not left & set(chosen), "a segment named in rewrite is still live"
        assert self.tier.num_rows(T) == before

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45 or not self.oracle:
            self.write()
        elif r < 0.65:
            self.delete()
        elif r < 0.8:
            self.compact()
        else:
            self.rewrite()

    # -- checks ---------------------------------------------------------------------------------
    def query(self, size: int) -> np.ndarray:
        present = np.fromiter(self.oracle, np.int64, len(self.oracle))
        parts = [
            self.rng.choice(present, min(len(present), size // 2), replace=False),
            self.rng.choice(self.pool, size // 4),
            self.rng.integers(I64.min, I64.max, size=size // 4, dtype=np.int64),
            SPECIAL_KEYS,
        ]
        return np.unique(np.concatenate(parts))

    def expected(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        found = np.array([k in self.oracle for k in keys.tolist()], bool)
        rows = [self.oracle[k] for k, f in zip(keys.tolist(), found) if f]
        return found, np.stack(rows) if rows else np.empty((0, self.width), np.float32)

    def check(self, big_query: bool = False) -> None:
        tier, why = self.tier, f"after {self.ops[-6:]}"
        n = len(self.oracle)
        # Counts: exact, per segment and in all.
        assert tier.num_rows(T) == n, why
        segs = [s for _, s in tier.segments(T)]
        sizes = {s: tier.segment_size(T, s) for s in segs}
        lives = {s: tier.segment_live(T, s) for s in segs}
        assert sum(lives.values()) == n, (why, lives)
        for s in segs:
            assert 0 <= lives[s] <= sizes[s], (why, s, lives[s], sizes[s])
        # Bounds the tier keeps: segments, rows stored per live row.
        assert len(segs) <= 2 * tier.max_segments + 1, (why, segs)
        assert sum(sizes.values()) <= 2 * n + 4096, (why, sizes, n)
        # On disk: the live segments and the protected ones, nothing else.
        protected = {s for t, s in tier.protected if t == T}
        on_disk = _dirs_on_disk(self.root, T)
        assert set(segs) <= on_disk, why
        assert on_disk <= set(segs) | protected, (why, sorted(on_disk - set(segs)))
        # Lookups: present and absent keys, each table's rows.
        q = self.query(12000 if big_query else 600)
        want_found, want_rows = self.expected(q)
        found, rows = tier.read(T, q)
        np.testing.assert_array_equal(found, want_found, err_msg=why)
        assert rows.shape == (int(want_found.sum()), self.width) and rows.dtype == np.float32
        np.testing.assert_array_equal(_bits(rows), _bits(want_rows), err_msg=why)
        uq = np.unique(np.concatenate([self.u_keys[::7], q[:50]]))
        got = tier.read_many({T: q, U: uq})
        np.testing.assert_array_equal(got[T][0], want_found)
        np.testing.assert_array_equal(_bits(got[T][1]), _bits(want_rows))
        u_at = np.searchsorted(self.u_keys, uq)
        u_found = (u_at < len(self.u_keys)) & (self.u_keys[np.minimum(u_at, len(self.u_keys) - 1)] == uq)
        np.testing.assert_array_equal(got[U][0], u_found)
        np.testing.assert_array_equal(got[U][1], self.u_rows[u_at[u_found]])
        # contains: any order, repeats.
        cq = self.rng.permutation(np.concatenate([q, q[: len(q) // 3]]))
        np.testing.assert_array_equal(tier.contains(T, cq), np.array([k in self.oracle for k in cq.tolist()]))
        # Scans: every live row once, in key order.
        all_keys = np.array(sorted(self.oracle), np.int64)
        np.testing.assert_array_equal(tier.keys(T), all_keys, err_msg=why)
        parts = list(tier.iter_rows(T))
        keys = np.concatenate([k for k, _ in parts]) if parts else np.empty(0, np.int64)
        rows = np.concatenate([r for _, r in parts]) if parts else np.empty((0, self.width), np.float32)
        np.testing.assert_array_equal(keys, all_keys)
        np.testing.assert_array_equal(_bits(rows), _bits(self.expected(all_keys)[1]))
        cols = slice(1, 3)
        scanned = [v for _, v in tier.scan(T, cols)]
        if scanned:
            np.testing.assert_array_equal(_bits(np.concatenate(scanned)), _bits(rows[:, cols]))


@pytest.mark.parametrize("width", [7, 64])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tier_equals_a_dict_under_random_operations(tmp_path, monkeypatch, seed, width):
    if seed % 2:  # small lookup and write slices: many dispatches per read, many slices per write
        monkeypatch.setattr(_ssd, "_LOOKUP_KEYS", 97)
        monkeypatch.setattr(_ssd, "_WRITE_SLICE_BYTES", 4 * width * 33)
    calls: list[int] = []
    compact = SsdTier.compact

    def counted(self, *args, **kwargs):
        calls.append(1)
        return compact(self, *args, **kwargs)

    monkeypatch.setattr(SsdTier, "compact", counted)
    rng = np.random.default_rng(seed)
    model = Model(tmp_path, width, rng, max_segments=int(rng.integers(2, 4)))
    for i in range(45):
        if i % 9 == 4:  # a run of writes: more segments than the tier keeps, it compacts by itself
            for _ in range(2 * model.tier.max_segments + 1):
                model.write(int(rng.integers(1, 200)))
                model.check()
        model.step()
        model.check(big_query=i % 15 == 14)
    asked = sum(op.startswith("compact") for op in model.ops)
    assert asked and any(op.startswith("delete") for op in model.ops)
    assert len(calls) > asked  # writes compacted by themselves too


def test_deleting_every_key_empties_the_table(tmp_path):
    model = Model(tmp_path, 7, np.random.default_rng(5))
    for size in (500, 800, 300):
        model.write(size)
    everything = np.fromiter(model.oracle, np.int64)
    assert model.tier.delete(T, everything) == len(everything)
    model.oracle.clear()
    model.ops.append("delete(all)")
    model.check()
    assert model.tier.segments(T) == [] and _dirs_on_disk(tmp_path, T) == set()
    assert model.tier.delete(T, everything) == 0 and model.tier.delete(T, np.empty(0, np.int64)) == 0
    model.write(100)
    model.check()


def _reloaded(model: Model) -> SsdTier:
    """A fresh tier on the same directory holding what a checkpoint of ``model.tier`` records."""
    recorded = model.tier.live_set(T)
    recorded_u = model.tier.live_set(U)
    fresh = SsdTier(model.root, max_segments=model.tier.max_segments, store_id="test")
    fresh.add_table(T, model.width)
    fresh.load_segments(T, model.width, recorded)
    fresh.load_segments(U, U_WIDTH, recorded_u)
    fresh.next_segment = fresh.max_segment_on_disk() + 1  # what a store does on opening
    return fresh


@pytest.mark.parametrize("width", [7, 64])
def test_reload_from_what_a_checkpoint_records(tmp_path, width):
    rng = np.random.default_rng(11 + width)
    model = Model(tmp_path, width, rng)
    for _ in range(14):  # large writes: segments of hundreds of rows at least
        r = rng.random()
        if r < 0.6 or not model.oracle:
            model.write(int(rng.integers(300, 2500)))
        elif r < 0.8:
            model.delete()
        else:
            model.compact()
        model.check()
    live_before = {s: model.tier.segment_live(T, s) for _, s in model.tier.segments(T)}
    model.tier.close()
    fresh = _reloaded(model)
    assert fresh.index_ram_bytes == 0  # nothing read yet: no fences, no filters
    assert {s: fresh.segment_live(T, s) for _, s in fresh.segments(T)} == live_before
    assert fresh.num_rows(T) == len(model.oracle)
    q = model.query(3000)
    found, rows = fresh.read(T, q)
    want_found, want_rows = model.expected(q)
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(_bits(rows), _bits(want_rows))
    # Fences and filters of T's segments only (U's are not read yet): under 2 bytes per stored key.
    stored = sum(fresh.segment_size(T, s) for _, s in fresh.segments(T))
    assert 0 < fresh.index_ram_bytes < 2 * stored, (fresh.index_ram_bytes, stored)
    fresh.read(U, model.u_keys)
    stored += len(model.u_keys)
    assert fresh.index_ram_bytes < 2 * stored, (fresh.index_ram_bytes, stored)
    # The reloaded tier goes on: the model checks it after each further operation.
    model.tier = fresh
    fresh.collect_garbage(set())
    model.ops.append("reload")
    model.check()
    for _ in range(8):
        model.step()
        model.check()


def test_protected_segments_survive_compaction(tmp_path):
    rng = np.random.default_rng(21)
    model = Model(tmp_path, 7, rng, max_segments=4)
    for size in (600, 700, 500, 650):
        model.write(size)
    live = [s for _, s in model.tier.segments(T)]
    assert len(live) >= 3
    # A "checkpoint" names every live segment; compaction then rewrites them all.
    model.tier.collect_garbage({(T, s) for s in live})
    assert model.tier.protected == {(T, s) for s in live}
    model.tier.compact(T, rewrite=live)
    model.ops.append("compact(rewrite=all)")
    assert not set(live) & {s for _, s in model.tier.segments(T)}
    assert set(live) <= _dirs_on_disk(tmp_path, T)  # named by the checkpoint: still there
    model.check()
    # The checkpoint retired for one naming only two of them: the others go at once.
    kept = set(live[:2])
    assert model.tier.collect_garbage({(T, s) for s in kept}) == len(live) - 2
    assert _dirs_on_disk(tmp_path, T) == {s for _, s in model.tier.segments(T)} | kept
    # Segments no checkpoint names are deleted as soon as they leave the live set (model.check
    # looks after every operation), the protected ones stay.
    unprotected = [s for _, s in model.tier.segments(T)]
    for _ in range(3):
        model.write(400)
        model.check()
    model.delete()
    model.check()
    model.tier.compact(T, rewrite=[s for _, s in model.tier.segments(T)])
    model.ops.append("compact(rewrite=all)")
    model.check()
    assert not set(unprotected) & _dirs_on_disk(tmp_path, T)
    assert kept <= _dirs_on_disk(tmp_path, T)
    # Unprotected, they go with the next garbage collection.
    assert model.tier.collect_garbage(set()) == len(kept)
    assert _dirs_on_disk(tmp_path, T) == {s for _, s in model.tier.segments(T)}
    model.check()


def _write_backs(tier: SsdTier, oracle: dict[int, np.ndarray], rng: np.random.Generator, n: int) -> None:
    """One write-back as a pass leaves it: ``n`` random keys of a small key space (overwrites), then
    the compaction that follows each pass."""
    keys = np.unique(rng.integers(0, 5000, n)).astype(np.int64)
    rows = rng.standard_normal((len(keys), 6), dtype=np.float32)
    tier.write(T, keys, rows)
    oracle.update(zip(keys.tolist(), rows))
    tier.compact(T)


def _reads_back(tier: SsdTier, oracle: dict[int, np.ndarray]) -> None:
    keys = np.array(sorted(oracle), np.int64)
    found, rows = tier.read(T, keys)
    assert found.all()
    np.testing.assert_array_equal(_bits(rows), _bits(np.stack([oracle[k] for k in keys.tolist()])))


def test_a_small_tables_write_backs_are_merged_once_there_are_more_than_a_few(tmp_path):
    # A small table written back pass after pass (a few hundred rows each): with max_segments of 16,
    # its segments would pile up to 16 and every lookup ask each of them. Small runs are merged
    # among themselves once there are more than _SMALL_RUNS of them.
    tier = SsdTier(tmp_path, max_segments=16, store_id="test")
    tier.add_table(T, 6)
    rng = np.random.default_rng(5)
    oracle: dict[int, np.ndarray] = {}
    most = 0
    for _ in range(30):
        _write_backs(tier, oracle, rng, 300)
        most = max(most, len(tier.segments(T)))
        assert len(tier.segments(T)) <= _ssd._SMALL_RUNS
    assert most == _ssd._SMALL_RUNS  # they gather up to the limit, then merge
    _reads_back(tier, oracle)


def test_the_small_run_merge_leaves_large_runs_alone(tmp_path, monkeypatch):
    # Runs over _SMALL_RUN_BYTES are merged by max_segments' size-tiered rule only: small write-backs
    # after a large one merge among themselves and never rewrite it.
    monkeypatch.setattr(_ssd, "_SMALL_RUN_BYTES", 600 * 4 * (6 + 2))  # 600 rows of width 6 and the key
    tier = SsdTier(tmp_path, max_segments=16, store_id="test")
    tier.add_table(T, 6)
    rng = np.random.default_rng(6)
    oracle: dict[int, np.ndarray] = {}
    _write_backs(tier, oracle, rng, 4000)  # about 2,800 distinct keys: large
    (large,) = [s for _, s in tier.segments(T)]
    for _ in range(20):
        _write_backs(tier, oracle, rng, 100)
        segs = [s for _, s in tier.segments(T)]
        # The large segment stays live, never rewritten; beside it small runs and what they merged into.
        assert large in segs and len(segs) <= 1 + _ssd._SMALL_RUNS + 1, segs
    _reads_back(tier, oracle)


def test_a_whole_checkpoint_snapshot_reads_back_after_later_work(tmp_path):
    rng = np.random.default_rng(31)
    model = Model(tmp_path, 64, rng, max_segments=3)
    for _ in range(6):
        model.step()
    model.write(800)
    snapshot = model.tier.live_set(T)
    snapshot_oracle = dict(model.oracle)
    model.tier.collect_garbage({(T, s) for s in snapshot})
    for _ in range(12):
        model.step()
        model.check()
    model.tier.compact(T, rewrite=[s for _, s in model.tier.segments(T)])
    model.ops.append("compact(rewrite=all)")
    model.check()
    assert set(snapshot) <= _dirs_on_disk(tmp_path, T)
    snap = SsdTier(tmp_path, store_id="test")
    snap.add_table(T, 64)
    snap.load_segments(T, 64, snapshot)
    assert snap.num_rows(T) == len(snapshot_oracle)
    keys = np.array(sorted(snapshot_oracle), np.int64)
    np.testing.assert_array_equal(snap.keys(T), keys)
    found, rows = snap.read(T, keys)
    assert found.all()
    np.testing.assert_array_equal(_bits(rows), _bits(np.stack([snapshot_oracle[k] for k in keys.tolist()])))
    snap.close()


def _segment(root: Path, zstore: LocalStore, files: OpenFiles, seg: int, keys, rows) -> Segment:
    width = rows.shape[1]
    writer = SegmentWriter(zstore, root, segment_name(T, seg), width, store_id="test")
    for a in range(0, len(keys), 37):  # in runs
        writer.append(keys[a : a + 37], rows[a : a + 37])
    n, check = writer.close()
    return Segment(root, zstore, T, seg, n, width, files, check, "test")


def test_merged_yields_the_newest_row_of_each_key_in_small_buffers(tmp_path):
    rng = np.random.default_rng(41)
    zstore, files, width = LocalStore(str(tmp_path)), OpenFiles(), 5
    newest: dict[int, tuple[int, np.ndarray]] = {}
    segs = []
    pool = _key_pool(rng)
    for seg in (3, 9, 4, 12):  # ids not in write order: the highest id is the newest
        keys = np.sort(rng.choice(pool, int(rng.integers(1, 1500)), replace=False))
        rows = rng.standard_normal((len(keys), width)).astype(np.float32)
        segs.append(_segment(tmp_path, zstore, files, seg, keys, rows))
        for k, r in zip(keys.tolist(), rows):
            if k not in newest or newest[k][0] < seg:
                newest[k] = (seg, r)
    for buffer_bytes in (1, 4 * (width + 2) * chunk_rows_for(width) + 1, 1 << 20):
        parts = list(merged(segs, width, buffer_bytes=buffer_bytes))
        keys = np.concatenate([k for k, _, _ in parts])
        want = np.array(sorted(newest), np.int64)
        np.testing.assert_array_equal(keys, want)
        np.testing.assert_array_equal(
            np.concatenate([r for _, r, _ in parts]), np.stack([newest[k][1] for k in want.tolist()])
        )
        np.testing.assert_array_equal(
            np.concatenate([s for _, _, s in parts]), [newest[k][0] for k in want.tolist()]
        )
    files.close()


def test_merged_sources_keeps_duplicates_newest_source_first():
    rng = np.random.default_rng(43)
    width, sources, entries = 2, [], []
    for src in range(4):
        keys = np.sort(rng.choice(300, int(rng.integers(0, 120)), replace=False)).astype(np.int64)
        rows = np.full((len(keys), width), src, np.float32)
        cuts = np.sort(rng.integers(0, len(keys) + 1, size=3))
        bounds = [0, *cuts.tolist(), len(keys)]
        sources.append(iter([(keys[a:b], rows[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]))
        entries += [(k, src) for k in keys.tolist()]
    out = list(merged_sources(sources, width))
    got = [(k, s) for keys, _, srcs in out for k, s in zip(keys.tolist(), srcs.tolist())]
    assert got == sorted(entries, key=lambda e: (e[0], -e[1]))
    for _, rows, srcs in out:
        np.testing.assert_array_equal(rows[:, 0], srcs)
    # Every entry of a key within one batch.
    for (k1, _, _), (k2, _, _) in zip(out[:-1], out[1:]):
        assert k1[-1] < k2[0]


# -- a store trained on demand ------------------------------------------------------------------------
N_KEYS, DIM, LR, MAX_SEGMENTS = 5000, 8, 0.1, 4


def _check_disk(store: hierps.Store, when: str, only_live: bool) -> None:
    """Segment directories of table t: the live set, bounded, and the checkpoint's; the live set's
    bytes on disk within twice the live rows' (plus chunk padding, filters, fences, metadata).
    ``only_live``: no older checkpoint names a segment, so nothing else is on disk."""
    store.num_rows("t")  # waits for background work
    tdir = store.path / "segments" / "t"
    dirs = {int(p.name) for p in tdir.iterdir() if p.is_dir()} if tdir.exists() else set()
    segs = {s for _, s in store_parts(store).core.ssd.segments("t")}
    protected = {s for t, s in store_parts(store).core.ssd.protected if t == "t"}
    assert len(segs) <= 2 * MAX_SEGMENTS + 1, (when, segs)
    assert segs <= dirs <= segs | protected, (when, dirs, segs, protected)
    if only_live:
        assert dirs == segs, (when, dirs, segs)
    disk = sum(f.stat().st_size for s in segs for f in (tdir / f"{s:08d}").rglob("*") if f.is_file())
    live = store_parts(store).core.ssd.num_rows("t") * (store.info("t").width + 2) * 4
    assert disk <= 2 * live * 1.3 + (256 << 10), (when, disk, live, store_parts(store).core.ssd.num_rows("t"))


def test_store_trained_on_demand_keeps_its_disk_bounded_and_equals_torch(tmp_path):
    path = tmp_path / "store"
    store = hierps.Store(
        path,
        device="cpu",
        device_budget="64KiB",
        memory_budget="16KiB",
        max_segments=MAX_SEGMENTS,
        keep_checkpoints=1,
    )
    bag = hierps.EmbeddingBag(
        None, DIM, mode="sum", store=store, name="t", optimizer={"type": "adagrad", "params": {"lr": LR}}
    )
    ref = nn.EmbeddingBag(N_KEYS, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(bag.lookup(torch.arange(N_KEYS)))
    opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
    rng = np.random.default_rng(0)
    batch, bag_len = 24, 4
    offsets = torch.arange(0, batch * bag_len, bag_len)
    for step in range(200):
        ids = torch.from_numpy(rng.integers(0, N_KEYS, size=batch * bag_len))
        target = torch.from_numpy(rng.standard_normal((batch, DIM)).astype(np.float32))
        for model in (bag, ref):
            ((model(ids, offsets) - target) ** 2).sum().backward()
        store.step()
        opt.step()
        opt.zero_grad()
        _check_disk(store, f"step {step}", only_live=store.checkpoint_id is None)
        if step in (99, 199):
            store.checkpoint()
            _check_disk(store, f"step {step}, after checkpoint", only_live=True)
    assert store_parts(store).core.ssd.num_rows("t") > 10 * store_parts(store).core.memory.num_rows("t")
    assert store_parts(store).core.ssd.rows_written > store_parts(store).core.ssd.num_rows(
        "t"
    )  # rows went through several segments
    tol = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(bag.lookup(torch.arange(N_KEYS)), ref.weight.detach(), **tol)
    rows_at_checkpoint = store_parts(store).core.ssd.num_rows("t")
    store.close()
    # Reopened at its checkpoint: the same rows, read from the segments the checkpoint names.
    with hierps.Store(path, device="cpu", memory_budget="16KiB", max_segments=MAX_SEGMENTS) as again:
        assert store_parts(again).core.ssd.num_rows("t") == rows_at_checkpoint
        got = again.lookup("t", torch.arange(N_KEYS))
        torch.testing.assert_close(got, ref.weight.detach(), **tol)
        _check_disk(again, "reopened", only_live=True)


# -- format version -----------------------------------------------------------------------------------
@pytest.mark.parametrize("old", [2, 3])
def test_a_store_of_an_older_format_version_is_refused_with_the_migration_recipe(tmp_path, old):
    path = tmp_path / "old"
    path.mkdir()
    write_json_atomic(path / "hierps.json", {"format": "hierps-store", "format_version": old})
    with pytest.raises(hierps.StoreFormatError) as err:
        hierps.Store(path, device="cpu")
    message = str(err.value)
    assert re.search(rf"version {old}\b", message), message
    assert re.search(rf"version {FORMAT_VERSION}\b", message), message
    assert "write_rows" in message, message
    assert ("rank-00000" in message) == (old == 3), message
    # Refused without touching it: the marker is as written, no lock is left held.
    with pytest.raises(hierps.StoreFormatError):
        hierps.Store(path, device="cpu")
    with pytest.raises(hierps.StoreFormatError, match="write_rows"):
        hierps.CheckpointReader(path)
