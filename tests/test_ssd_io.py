"""The SSD tier's direct chunk I/O: what hierps writes is a Zarr v3 array zarr reads identically,
each chunk bound to its array and position (arrays without binding tags, as zarr writes them, are
refused), and damage is reported."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import crc32c
import numpy as np
import pytest
import zarr
import zarr.codecs
from zarr.storage import LocalStore

from hierps.bench.machine import drop_from_page_cache
from hierps.errors import CorruptStoreError
from hierps.storage import _arrays, _native, _reads
from hierps.storage._arrays import create_array, open_array
from hierps.storage._reads import read_array
from hierps.tiers._ssd import SsdTier

RNG = np.random.default_rng(7)
ROWS = RNG.standard_normal((1000, 37), dtype=np.float32)
KEYS = np.sort(RNG.choice(1 << 40, 1000, replace=False)).astype(np.int64)


def _positions(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n, k, replace=False))


@pytest.mark.parametrize("chunk_rows", [1, 27, 999, 1000, 4096])
def test_zarr_reads_what_hierps_writes(tmp_path, chunk_rows):
    zstore = LocalStore(str(tmp_path))
    create_array(zstore, "s/rows", ROWS, chunk_rows, identity="s/rows")
    create_array(zstore, "s/keys", KEYS, chunk_rows, identity="s/keys")
    rows = zarr.open_array(zstore, path="s/rows", mode="r")
    assert rows.shards is not None and rows.chunks == (min(chunk_rows, 4096), 37)
    np.testing.assert_array_equal(rows[:], ROWS)
    np.testing.assert_array_equal(zarr.open_array(zstore, path="s/keys", mode="r")[:], KEYS)
    # ... and hierps reads it back, whole and at scattered positions.
    arr = open_array(zstore, tmp_path, "s/rows", "float32", 2, identity="s/rows")
    np.testing.assert_array_equal(read_array(arr, tmp_path, "s/rows"), ROWS)
    for k in (1, 5, 300, 1000):
        pos = _positions(1000, k, k)
        np.testing.assert_array_equal(read_array(arr, tmp_path, "s/rows", pos), ROWS[pos])
        keys = open_array(zstore, tmp_path, "s/keys", "int64", 1, identity="s/keys")
        np.testing.assert_array_equal(read_array(keys, tmp_path, "s/keys", pos), KEYS[pos])


def test_empty_array_round_trips(tmp_path):
    zstore = LocalStore(str(tmp_path))
    create_array(zstore, "e", np.empty(0, np.int64), 1, identity="e")
    assert zarr.open_array(zstore, path="e", mode="r")[:].shape == (0,)
    assert read_array(open_array(zstore, tmp_path, "e", "int64", 1, identity="e"), tmp_path, "e").shape == (
        0,
    )


@pytest.mark.parametrize(
    "layout",
    [
        {"chunks": (8, 37), "shards": (64, 37)},  # several shards, the last one partly empty
        {"chunks": (50, 37), "shards": (1000, 37)},
        {"chunks": (64, 37)},  # one file per chunk
    ],
)
def test_arrays_zarr_wrote_are_refused_they_carry_no_binding_tags(tmp_path, layout):
    zstore = LocalStore(str(tmp_path))
    zarr.create_array(
        zstore,
        name="a",
        data=ROWS,
        compressors=[zarr.codecs.Crc32cCodec()],
        fill_value=0,
        config={"write_empty_chunks": True},
        **layout,
    )
    with pytest.raises(CorruptStoreError, match="not an array hierps wrote"):
        open_array(zstore, tmp_path, "a", "float32", 2, identity="a")


def test_a_chunk_is_bound_to_its_array_and_its_position(tmp_path):
    """Intact chunks in the wrong place pass their crc32c; their binding tags do not."""
    zstore = LocalStore(str(tmp_path))
    for name in ("x", "y"):
        create_array(zstore, name, ROWS, 27, identity=f"store:{name}")
    shard = tmp_path / "x" / "c" / "0" / "0"
    # Opened as what it is not:
    arr = open_array(zstore, tmp_path, "x", "float32", 2, identity="store:y")
    with pytest.raises(CorruptStoreError, match=r"chunk 0 is intact but is not the chunk of 'store:y'"):
        read_array(arr, tmp_path, "x", np.array([0]))
    # A shard copied over another's of the same shape:
    shutil.copy(tmp_path / "y" / "c" / "0" / "0", shard)
    arr = open_array(zstore, tmp_path, "x", "float32", 2, identity="store:x")
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*is not the chunk of 'store:x'"):
        read_array(arr, tmp_path, "x")
    # Two inner chunks swapped within a shard:
    create_array(zstore, "x", ROWS, 27, identity="store:x")
    arr = open_array(zstore, tmp_path, "x", "float32", 2, identity="store:x")
    data = bytearray(shard.read_bytes())
    a, b = int(arr.chunk_offsets(np.array([2]))[0]), int(arr.chunk_offsets(np.array([5]))[0])
    size = arr.chunk_bytes
    data[a : a + size], data[b : b + size] = data[b : b + size], data[a : a + size]
    shard.write_bytes(bytes(data))
    np.testing.assert_array_equal(read_array(arr, tmp_path, "x", np.arange(27)), ROWS[:27])  # others read
    with pytest.raises(CorruptStoreError, match="chunk 2 is intact but is not the chunk"):
        read_array(arr, tmp_path, "x", np.array([2 * 27 + 1]))
    # zarr still reads the array, tags and all, as the data it holds
    np.testing.assert_array_equal(zarr.open_array(zstore, path="y", mode="r")[:], ROWS)


def test_far_apart_rows_read_in_parallel_pieces(tmp_path, monkeypatch):
    """Many runs (no coalescing, tiny pieces) go through the thread pool and come back in order."""
    monkeypatch.setattr(_reads, "_GAP_BYTES", 0)
    monkeypatch.setattr(_reads, "_PIECE_BYTES", 1)
    zstore = LocalStore(str(tmp_path))
    create_array(zstore, "r", ROWS, 3, identity="r")
    arr = open_array(zstore, tmp_path, "r", "float32", 2, identity="r")
    pos = _positions(1000, 400, 3)
    np.testing.assert_array_equal(read_array(arr, tmp_path, "r", pos), ROWS[pos])


def _in_page_cache(path: Path) -> bool:
    """Whether the page cache holds ``path``'s last page (tmpfs: always)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], os.fstat(fd).st_size - 4096, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not _native.enabled(), reason="the page-cache reads are the compiled core's")
def test_what_the_page_cache_holds_is_read_by_the_caller_the_rest_by_the_read_threads(tmp_path, monkeypatch):
    """A lookup's chunks in the page cache are read, checked and gathered by the calling thread (no
    task handed to the read threads); after the file's pages leave the cache its runs go to the
    threads, and with half of them cached the runs before the first one missing are the caller's.
    The rows are exact every time, and a damaged chunk is refused on both paths."""
    monkeypatch.setattr(_reads, "_GAP_BYTES", 0)
    monkeypatch.setattr(_reads, "_PIECE_BYTES", 1)  # a run per chunk
    rows = np.random.default_rng(3).standard_normal((20000, 37), dtype=np.float32)
    zstore = LocalStore(str(tmp_path))
    create_array(zstore, "r", rows, 27, identity="r")
    arr = open_array(zstore, tmp_path, "r", "float32", 2, identity="r")
    handed: list[tuple[int, int]] = []
    run = _reads._Reader._run
    monkeypatch.setattr(
        _reads._Reader,
        "_run",
        lambda self, read, first, stop: (handed.append((first, stop)), run(self, read, first, stop)),
    )

    def lookup(pos: np.ndarray) -> np.ndarray:  # two requests: not the lone request read inline
        first, second = _reads.read_arrays([(arr, pos[: len(pos) // 2]), (arr, pos[len(pos) // 2 :])])
        return np.concatenate([first, second])

    pos = np.arange(0, 20000, 97)  # rows of different chunks: a run each
    if Path("/dev/shm").is_dir():  # tmpfs refuses RWF_NOWAIT: its reads go to the threads, exact
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            create_array(LocalStore(shm), "m", rows[:3000], 27, identity="m")
            mem = open_array(LocalStore(shm), Path(shm), "m", "float32", 2, identity="m")
            a, b = _reads.read_arrays([(mem, pos[:10]), (mem, pos[10:30])])
            np.testing.assert_array_equal(np.concatenate([a, b]), rows[pos[:30]])
            assert handed
            handed.clear()
    np.testing.assert_array_equal(lookup(pos), rows[pos])
    assert handed == []  # (a file system refusing it earlier in the process does not turn it off)
    drop_from_page_cache(_shard(tmp_path / "r"))
    if _in_page_cache(_shard(tmp_path / "r")):
        pytest.skip("this file system keeps the file's pages in memory (tmpfs)")
    np.testing.assert_array_equal(lookup(pos), rows[pos])
    assert sum(stop - first for first, stop in handed) == len(pos)  # a run per row, every one
    handed.clear()
    shard = _shard(tmp_path / "r")
    lookup(pos[: len(pos) // 2])  # the first half's chunks in the cache again
    drop_from_page_cache(shard, start=shard.stat().st_size // 2)
    handed.clear()
    np.testing.assert_array_equal(lookup(pos), rows[pos])
    assert handed and min(first for first, _ in handed) > 0  # the runs before were the caller's
    data = bytearray(shard.read_bytes())
    data[(27 * 148 + 4 + _arrays.TAG_BYTES) * 2 + 10] ^= 1  # inside inner chunk 2: cached after the write
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*crc32c"):
        lookup(np.array([0, 2 * 27 + 1, 3 * 27]))
    drop_from_page_cache(shard)
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*crc32c"):
        lookup(np.array([0, 2 * 27 + 1, 3 * 27]))


@pytest.fixture
def written(tmp_path) -> tuple[LocalStore, Path]:
    zstore = LocalStore(str(tmp_path))
    create_array(zstore, "r", ROWS, 27, identity="r")
    return zstore, tmp_path


def test_unsorted_and_repeated_positions(written):
    zstore, root = written
    arr = open_array(zstore, root, "r", "float32", 2, identity="r")
    pos = np.array([999, 3, 3, 500, 0, 998])
    np.testing.assert_array_equal(read_array(arr, root, "r", pos), ROWS[pos])
    with pytest.raises(CorruptStoreError, match="rows 0..1000 asked of an array of 1000 rows"):
        read_array(arr, root, "r", np.array([0, 1000]))


def _shard(path: Path) -> Path:
    return path / "c" / "0" / "0"


def test_flipped_byte_in_an_inner_chunk_names_the_shard(written):
    zstore, root = written
    shard = _shard(root / "r")
    data = bytearray(shard.read_bytes())
    data[(27 * 148 + 4 + _arrays.TAG_BYTES) * 5 + 10] ^= 1  # inside inner chunk 5 (rows 135..161)
    shard.write_bytes(bytes(data))
    arr = open_array(zstore, root, "r", "float32", 2, identity="r")
    # Rows of other chunks still read; any read touching chunk 5 fails.
    np.testing.assert_array_equal(read_array(arr, root, "r", np.arange(0, 100)), ROWS[:100])
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*crc32c"):
        read_array(arr, root, "r", np.array([140]))


def test_damaged_shard_index_is_refused_on_open(written):
    zstore, root = written
    shard = _shard(root / "r")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CorruptStoreError, match=re.escape(str(shard)) + ": the shard index failed its crc32c"
    ):
        open_array(zstore, root, "r", "float32", 2, identity="r")


def test_index_with_a_missing_inner_chunk_is_refused(written):
    """An inner chunk marked empty would read as zeros in zarr: hierps refuses the array."""
    zstore, root = written
    shard = _shard(root / "r")
    data = bytearray(shard.read_bytes())
    n_chunks = 38
    index = np.frombuffer(bytes(data[-(16 * n_chunks + 4) : -4]), "<u8").copy().reshape(n_chunks, 2)
    index[3] = (1 << 64) - 1
    raw = index.tobytes()
    data[-(16 * n_chunks + 4) :] = raw + crc32c.crc32c(raw).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="chunk missing"):
        open_array(zstore, root, "r", "float32", 2, identity="r")


def test_missing_and_truncated_shard(written):
    zstore, root = written
    shard = _shard(root / "r")
    arr = open_array(zstore, root, "r", "float32", 2, identity="r")
    shard.write_bytes(shard.read_bytes()[: 27 * 148 * 2])
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*truncated"):
        read_array(arr, root, "r", np.array([999]))
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard))):
        open_array(zstore, root, "r", "float32", 2, identity="r")
    shard.unlink()
    with pytest.raises(CorruptStoreError, match="chunk missing"):
        open_array(zstore, root, "r", "float32", 2, identity="r")


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(index_location="start"),
        lambda c: c.update(index_codecs=[_arrays._CODECS[0]]),
        lambda c: c.update(codecs=[*_arrays._CODECS, {"name": "gzip", "configuration": {"level": 1}}]),
        lambda c: c.update(chunk_shape=[27, 5]),  # inner chunks not full width
        lambda c: c.update(chunk_shape=[25, 37]),  # not dividing the shard
    ],
)
def test_other_sharding_configurations_are_refused(written, edit):
    zstore, root = written
    meta_path = root / "r" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    edit(meta["codecs"][0]["configuration"])
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CorruptStoreError, match="not an array hierps wrote"):
        open_array(zstore, root, "r", "float32", 2, identity="r")


def test_ssd_tier_reads_exact_rows_across_segments(tmp_path):
    """Rows overwritten across several segments read back as the latest written, through scan too."""
    tier = SsdTier(tmp_path, store_id="test")
    tier.add_table("t", 37)
    expected = {}
    for i in range(4):
        keys = np.random.default_rng(i).choice(5000, 1500, replace=False).astype(np.int64)
        rows = np.random.default_rng(100 + i).standard_normal((len(keys), 37), dtype=np.float32)
        tier.write("t", keys, rows)
        expected.update(zip(keys.tolist(), rows))
    want = np.array(sorted(expected), dtype=np.int64)
    found, rows = tier.read("t", want)
    assert found.all()
    np.testing.assert_array_equal(rows, np.stack([expected[k] for k in want.tolist()]))
    scanned = {k: v for keys, vals in tier.scan("t", slice(0, 37)) for k, v in zip(keys.tolist(), vals)}
    assert sorted(scanned) == want.tolist()
    np.testing.assert_array_equal(np.stack([scanned[k] for k in want.tolist()]), rows)
    tier.compact("t", max_segments=1)
    assert len(tier.segments("t")) == 1
    np.testing.assert_array_equal(tier.read("t", want)[1], rows)
    seg = tier.segments("t")[0][1]
    on_disk = zarr.open_array(str(tmp_path / "t" / f"{seg:08d}" / "rows"), mode="r")[:]
    np.testing.assert_array_equal(np.ascontiguousarray(on_disk[:, :2]).view(np.int64).reshape(-1), want)


def _tier_of_many_tables(root: Path) -> tuple[SsdTier, dict[str, np.ndarray]]:
    """Five tables of different widths, each written as several overlapping segments."""
    tier = SsdTier(root, store_id="test")
    requests = {}
    for t, width in enumerate([3, 16, 37, 5, 64]):
        name = f"t{t}"
        tier.add_table(name, width)
        for i in range(3 + t % 2):
            rng = np.random.default_rng(10 * t + i)
            keys = rng.choice(4000, 1200, replace=False).astype(np.int64)
            tier.write(name, keys, rng.standard_normal((len(keys), width), dtype=np.float32))
        # Keys from the whole range: some were never written.
        requests[name] = np.sort(np.random.default_rng(t).choice(5000, 900 + 100 * t, replace=False)).astype(
            np.int64
        )
    requests["t3"] = np.empty(0, np.int64)  # an empty request
    return tier, requests


def test_read_many_equals_read_per_table(tmp_path):
    tier, requests = _tier_of_many_tables(tmp_path)
    expected = {name: tier.read(name, keys) for name, keys in requests.items()}
    rows_read, bytes_read = tier.rows_read, tier.bytes_read
    got = tier.read_many(requests)
    assert list(got) == list(requests)
    for name, (found, rows) in got.items():
        np.testing.assert_array_equal(found, expected[name][0])
        np.testing.assert_array_equal(rows, expected[name][1])
        assert rows.dtype == np.float32 and rows.shape == (found.sum(), tier.widths[name])
    assert not found.all() and got["t0"][0].any()  # both absent and present keys were asked
    assert tier.rows_read - rows_read == sum(len(r) for _, r in got.values())
    assert tier.bytes_read - bytes_read == sum(r.nbytes for _, r in got.values())
    assert tier.read_many({}) == {}


def test_read_many_names_the_corrupted_segment(tmp_path):
    tier, requests = _tier_of_many_tables(tmp_path)
    seg = tier.segments("t2")[-1][1]
    seg_dir = tmp_path / "t2" / f"{seg:08d}"
    first_row = zarr.open_array(str(seg_dir / "rows"), mode="r")[:1]
    in_first_chunk = np.ascontiguousarray(first_row[:, :2]).view(np.int64).reshape(-1)
    shard = _shard(seg_dir / "rows")
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # inside the first inner chunk
    shard.write_bytes(bytes(data))
    requests["t2"] = np.union1d(requests["t2"], in_first_chunk)
    others = {name: keys for name, keys in requests.items() if name != "t2"}
    assert set(tier.read_many(others)) == set(others)  # the other tables still read
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*crc32c"):
        tier.read_many(requests)
    with pytest.raises(CorruptStoreError, match=re.escape(str(shard)) + ".*crc32c"):
        tier.read("t2", requests["t2"])


def test_a_scan_abandoned_in_a_reference_cycle_is_finalized_under_the_files_lock(tmp_path):
    """A scan left half read inside a reference cycle (as an exception's traceback leaves one) holds
    its files until the garbage collector finalizes it, which may happen while the very thread holds
    the open-files lock: its reads end and its files are released there, without a deadlock."""
    tier = SsdTier(tmp_path, store_id="test")
    tier.add_table("t", 16)
    keys = np.arange(200_000, dtype=np.int64)
    tier.write("t", keys, np.ones((len(keys), 16), np.float32))
    seg = next(iter(tier._segs["t"].values()))
    scan = seg.scan(4096)
    assert 0 < len(next(scan)[0]) < len(keys)  # half read: its next batches in flight
    cycle: list = [scan]
    cycle.append(cycle)
    del scan, cycle
    files = tier._files
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        gc.disable()  # collected here, at this point, not at an allocation elsewhere
        try:
            with files._lock:
                gc.collect()
        finally:
            gc.enable()
            done.set()

    worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
    worker.start()
    assert done.wait(30), "the scan's finalizer waited for the lock its own thread held"
    assert not files._pins  # every descriptor the scan held is released
    assert np.array_equal(tier.keys("t"), keys)  # and the tier reads on
