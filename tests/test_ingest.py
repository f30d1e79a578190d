"""Bulk loads: ``write_rows`` of rows in a key range no tier holds goes straight to the SSD tier as
one segment, written once, and segments of disjoint key ranges form a run that compaction counts
and merges as one. The rows read back are those of the ordinary path (through the RAM tier), bit
for bit, after overlapping writes, compaction, reopening, and a kill in the middle of an ingest.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import hierps
import hierps._rows as rows_module
from hierps._store import store_parts
from hierps.storage import _merge, _native
from hierps.tiers import _ssd as ssd_module
from hierps.tiers._ssd import SsdTier

CHUNK = 3000
DIM = 4


@pytest.fixture
def small_runs(monkeypatch):
    """Bulk loads and runs at test sizes: any write_rows over 1 KiB is a bulk load, any segment
    over 1 KiB joins runs."""
    monkeypatch.setattr(rows_module, "INGEST_BYTES", 1024)
    monkeypatch.setattr(_merge, "RUN_BYTES", 1024)


def _rows(info, n: int, rng: np.random.Generator) -> np.ndarray:
    """Decoded rows of adagrad table ``info``: random weights, random non-negative state, no counters."""
    rows = np.zeros((n, info.width), np.float32)
    rows[:, :DIM] = rng.standard_normal((n, DIM), dtype=np.float32)
    rows[:, DIM : info.state_end] = np.abs(rng.standard_normal((n, info.state_end - DIM), dtype=np.float32))
    return rows


def _bulk_write(path: Path, chunks: int, seed: int = 0, **settings) -> hierps.Store:
    """A store whose table ``t`` got ``chunks`` ascending chunks of CHUNK keys through write_rows."""
    store = hierps.Store(path, device="cpu", memory_budget="64KiB", **settings)
    info = store.table("t", DIM, optimizer="adagrad")
    rng = np.random.default_rng(seed)
    for c in range(chunks):
        keys = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.int64)
        store.write_rows("t", keys, _rows(info, CHUNK, rng))
    return store


def _read_all(path: Path, n: int) -> np.ndarray:
    with hierps.Store(path, device="cpu") as store:
        assert store.num_rows("t")["ssd"] == n
        return store.read_rows("t", np.arange(n, dtype=np.int64)).view(np.uint32)


def test_a_bulk_write_reads_back_as_the_ordinary_path(tmp_path, small_runs, monkeypatch):
    chunks = 10
    bulk = _bulk_write(tmp_path / "bulk", chunks, max_segments=3)
    ssd = store_parts(bulk).core.ssd
    # One segment a call, each row written once; a single run, which no compaction rewrote.
    assert len(ssd.segments("t")) == chunks and len(ssd.runs("t")) == 1
    assert ssd.rows_written == chunks * CHUNK
    bulk.checkpoint()
    bulk.close()
    monkeypatch.setattr(rows_module, "INGEST_BYTES", 1 << 62)  # every row through the RAM tier
    plain = _bulk_write(tmp_path / "plain", chunks, max_segments=3)
    assert store_parts(plain).core.memory.num_rows("t") > 0
    plain.checkpoint()
    plain.close()
    np.testing.assert_array_equal(
        _read_all(tmp_path / "bulk", chunks * CHUNK), _read_all(tmp_path / "plain", chunks * CHUNK)
    )


def test_overlapping_writes_after_an_ingest_read_the_newest_rows(tmp_path, small_runs):
    store = _bulk_write(tmp_path / "store", 6, seed=1, max_segments=2)
    info = store.info("t")
    rng = np.random.default_rng(2)
    oracle = dict(zip(range(6 * CHUNK), store.read_rows("t", np.arange(6 * CHUNK))))
    for step in range(8):
        if step % 3 == 2:  # another bulk load above every key: a segment of its own
            start = max(oracle) + 1 + int(rng.integers(0, 100))
            keys = np.arange(start, start + CHUNK, dtype=np.int64)
        else:  # keys of the loads and new ones among them, in any order: the ordinary path
            keys = rng.permutation(rng.choice(max(oracle) + 500, 2 * CHUNK, replace=False)).astype(np.int64)
        rows = _rows(info, len(keys), rng)
        store.write_rows("t", keys, rows)
        oracle.update(zip(keys.tolist(), rows[:, : info.state_end]))
        if step % 4 == 3:
            store_parts(store).core.ssd.compact("t", max_segments=1)
        if step == 5:
            store.checkpoint()
    keys = np.array(sorted(oracle), np.int64)
    want = np.stack([oracle[k] for k in keys.tolist()]).view(np.uint32)
    np.testing.assert_array_equal(store.read_rows("t", keys).view(np.uint32), want)
    store.checkpoint()
    path = store.path
    store.close()
    with hierps.Store(path, device="cpu") as again:
        assert again.num_rows("t")["ssd"] == len(keys)
        np.testing.assert_array_equal(again.read_rows("t", keys).view(np.uint32), want)


def test_a_run_counts_once_and_is_never_rewritten_for_its_segments(tmp_path, small_runs):
    tier = SsdTier(tmp_path, max_segments=2, store_id="test")
    tier.add_table("t", 6)
    rng = np.random.default_rng(3)
    oracle: dict[int, np.ndarray] = {}
    for c in range(12):  # descending loads: each below every key stored, a run all the same
        keys = np.arange((20 - c) * 100, (21 - c) * 100, dtype=np.int64)
        rows = rng.standard_normal((100, 6), dtype=np.float32)
        assert tier.disjoint("t", int(keys[0]), int(keys[-1]))
        tier.ingest("t", [(keys[:40], rows[:40]), (keys[40:], rows[40:])], 100, int(keys[0]), int(keys[-1]))
        tier.settle("t")
        oracle.update(zip(keys.tolist(), rows))
    assert not tier.disjoint("t", 950, 1000)
    with pytest.raises(ValueError):
        tier.ingest("t", [], 0, 950, 1000)
    assert len(tier.segments("t")) == 12 and len(tier.runs("t")) == 1 and tier.rows_written == 1200
    # Overlapping writes: runs of their own, merged as units; the newest row of each key wins.
    for _ in range(6):
        keys = np.unique(rng.integers(800, 2200, 150)).astype(np.int64)
        rows = rng.standard_normal((len(keys), 6), dtype=np.float32)
        tier.write("t", keys, rows)
        oracle.update(zip(keys.tolist(), rows))
    assert len(tier.runs("t")) <= 2 * tier.max_segments + 1
    want = np.array(sorted(oracle), np.int64)
    found, got = tier.read("t", want)
    assert found.all()
    np.testing.assert_array_equal(got, np.stack([oracle[k] for k in want.tolist()]))
    keys = np.concatenate([k for k, _ in tier.iter_rows("t")])
    np.testing.assert_array_equal(keys, want)
    tier.compact("t", max_segments=1)
    assert len(tier.segments("t")) == 1
    np.testing.assert_array_equal(tier.read("t", want)[1], np.stack([oracle[k] for k in want.tolist()]))


def test_runs_group_consecutive_disjoint_segments(tmp_path, small_runs):
    tier = SsdTier(tmp_path, max_segments=100, store_id="test")
    tier.add_table("t", 6)
    spans = [(0, 99), (200, 299), (100, 199), (150, 190), (300, 399), (1000, 1000)]
    for lo, hi in spans:
        keys = np.arange(lo, hi + 1, dtype=np.int64)
        tier.write("t", keys, np.zeros((len(keys), 6), np.float32))
    # Each run in key order; (150, 190) overlaps (100, 199): a new run starts there; (1000, 1000)
    # is too small to join one.
    assert tier.runs("t") == [[1, 3, 2], [4, 5], [6]]


def _newest_holders(
    written: dict[int, dict[int, np.ndarray]], keys: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Brute force: each key looked up in every segment of ``written`` (id -> {key: row}), newest
    first -> found (n,), holder (n,) (-1 if none), rows (n, width) (zero where not found)."""
    found, holder = np.zeros(len(keys), bool), np.full(len(keys), -1, np.int64)
    rows = np.zeros((len(keys), width), np.float32)
    for i, key in enumerate(keys.tolist()):
        for seg in sorted(written, reverse=True):
            if key in written[seg]:
                found[i], holder[i], rows[i] = True, seg, written[seg][key]
                break
    return found, holder, rows


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("reopened", [False, True])
def test_a_lookup_over_many_segments_finds_each_keys_newest_holder(tmp_path, monkeypatch, native, reopened):
    """Many bulk loads (key-disjoint segments, gaps between them, every other key inside them) and
    newer segments overlapping them and each other: the found flags, holders and rows of a lookup
    (slices of 61 keys, which cross segment boundaries) equal a brute-force search of the segments
    newest first, over the live set and over part of it (``among``), with the compiled core and
    without, in the tier that wrote them (ranges known) and in one reopened on them (ranges loaded
    as the lookup asks them)."""
    monkeypatch.setattr(ssd_module, "_LOOKUP_KEYS", 61)
    width = 5
    tier = SsdTier(tmp_path, max_segments=1000, store_id="test")
    tier.add_table("t", width)
    rng = np.random.default_rng(4)
    written: dict[int, dict[int, np.ndarray]] = {}

    def wrote(keys: np.ndarray, rows: np.ndarray) -> None:
        written[max(s for _, s in tier.segments("t"))] = dict(zip(keys.tolist(), rows))

    start = -5000
    for step in range(48):
        rows = rng.standard_normal((150, width), dtype=np.float32)
        if step % 8 == 7:  # a newer segment over the loads so far, their gaps and beyond them
            keys = np.unique(rng.integers(-5100, start + 100, 150)).astype(np.int64)
            tier.write("t", keys, rows[: len(keys)])
            start += 200  # the next load above its keys too
        else:  # a bulk load above every key stored
            keys = np.arange(start, start + 300, 2, dtype=np.int64)
            tier.ingest("t", [(keys, rows)], len(keys), int(keys[0]), int(keys[-1]))
            start += 300 + int(rng.integers(0, 40))
        wrote(keys, rows[: len(keys)])
    assert len(tier.segments("t")) == len(written)  # nothing compacted: every segment is asked
    if reopened:
        live = tier.live_set("t")
        tier = SsdTier(tmp_path, max_segments=1000, store_id="test")
        tier.load_segments("t", width, live)
    stored = np.array(sorted({k for rows in written.values() for k in rows}), np.int64)
    keys = np.unique(
        np.concatenate([rng.choice(stored, 2000, replace=False), rng.integers(-5200, start + 200, 900)])
    )
    some = sorted(rng.choice(sorted(written), 20, replace=False).tolist())
    with contextlib.nullcontext() if native else _native.disabled():
        for among in (some, None):
            want_found, want_holder, want_rows = _newest_holders(
                written if among is None else {s: written[s] for s in among}, keys, width
            )
            assert want_found.any() and not want_found.all()
            found, holder, rows = tier._locate(
                {"t": keys}, with_rows=True, among=None if among is None else {"t": among}
            )["t"]
            np.testing.assert_array_equal(found, want_found)
            np.testing.assert_array_equal(holder, want_holder)
            np.testing.assert_array_equal(rows[found].view(np.uint32), want_rows[found].view(np.uint32))
        found, rows = tier.read("t", keys)  # the live set's newest rows (the last reference)
        np.testing.assert_array_equal(found, want_found)
        np.testing.assert_array_equal(rows.view(np.uint32), want_rows[want_found].view(np.uint32))


_CRASH = """
import numpy as np, hierps, hierps._rows as R, hierps._faults as F
from hierps.storage import _merge
R.INGEST_BYTES = 1024
_merge.RUN_BYTES = 1024
store = hierps.Store({path!r}, device="cpu", memory_budget="64KiB")
info = store.table("t", {dim}, optimizer="adagrad")
rng = np.random.default_rng(0)
def rows(n):
    out = np.zeros((n, info.width), np.float32)
    out[:, :{dim}] = rng.standard_normal((n, {dim}), dtype=np.float32)
    return out
for c in range(3):
    store.write_rows("t", np.arange(c * {chunk}, (c + 1) * {chunk}), rows({chunk}))
store.checkpoint()
np.save({saved!r}, store.read_rows("t", np.arange(3 * {chunk})))
F.arm({fault!r})
store.write_rows("t", np.arange(3 * {chunk}, 4 * {chunk}), rows({chunk}))
store.write_rows("t", np.arange(0, {chunk}), rows({chunk}))
store.checkpoint()
"""


@pytest.mark.parametrize(
    "fault",
    ["ssd.segment_begin", "ssd.segment_rows_block", "ssd.segment_rows_written", "ssd.segment_written"],
)
def test_a_kill_in_the_middle_of_an_ingest_leaves_the_last_checkpoint(tmp_path, fault):
    path, saved = tmp_path / "store", tmp_path / "rows.npy"
    code = _CRASH.format(path=str(path), dim=DIM, chunk=CHUNK, saved=str(saved), fault=fault)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    want = np.load(saved).view(np.uint32)
    segments = sorted(p.name for p in (path / "segments" / "t").iterdir())
    with hierps.Store(path, device="cpu") as store:
        assert store.num_rows("t")["ssd"] == 3 * CHUNK
        np.testing.assert_array_equal(store.read_rows("t", np.arange(3 * CHUNK)).view(np.uint32), want)
        assert not store_parts(store).core.stored("t", np.arange(3 * CHUNK, 4 * CHUNK)).any()  # not committed
        assert len(store_parts(store).core.ssd.segments("t")) == 3
    # What the killed ingest left is gone once reopened.
    assert len(list((path / "segments" / "t").iterdir())) == 3 <= len(segments)
    shutil.rmtree(path)


def test_runs_made_beside_come_in_order_raise_their_error_and_stop_when_closed():
    """A scan made on a thread of its own (each part of a reshard) gives its items in order, raises
    what it raises, and closed early stops making items and closes its source."""
    import threading
    import time

    from hierps.storage._files import made_beside

    assert list(made_beside(iter(range(50)))) == list(range(50))

    def failing():
        yield from range(3)
        raise OSError("the third read failed")

    got = []
    with pytest.raises(OSError, match="the third read failed"):
        for item in made_beside(failing()):
            got.append(item)
    assert got == [0, 1, 2]

    made, closed = [], threading.Event()

    def endless():
        try:
            for i in range(10**6):
                made.append(i)
                yield i
        finally:
            closed.set()

    source = endless()  # held here too: only an explicit close() ends it
    beside = made_beside(source)
    assert [next(beside), next(beside)] == [0, 1]
    beside.close()
    assert closed.is_set()  # the thread closed its source before close() returned
    count = len(made)
    time.sleep(0.1)
    assert len(made) == count <= 4  # at most the items in hand, in the queue and under way


def test_runs_appended_beside_keep_their_order_and_end_before_an_error_comes_out():
    """A bulk write's appends (each on a thread of their own while the next run is made) come in the
    order of the runs; when making a run fails, the append under way has ended by the time the
    error reaches the writer's owner (who then aborts the writer)."""
    import time

    from hierps.storage._files import append_all

    done: list[int] = []

    def append(keys, rows):
        time.sleep(0.02)
        done.append(int(keys[0]))

    append_all(append, ((np.array([i]), np.zeros((1, 2))) for i in range(6)))
    assert done == list(range(6))

    def runs():
        for i in range(3):
            yield np.array([i]), np.zeros((1, 2))
        raise ValueError("a run out of order")

    done.clear()
    with pytest.raises(ValueError, match="a run out of order"):
        append_all(append, runs())
    assert done == [0, 1, 2]  # the last append ended before the error came out
