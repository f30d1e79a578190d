"""The compiled core of the storage layer (hierps.storage._native) computes what the numpy code does.

- crc32c equals the crc32c package's bit for bit: random buffers of every length 0..N, unaligned
  starts, continued values, with the CPU's crc32 instruction and with the table;
- reads (check + binding tag + gather in one pass, on the read threads) return the rows the numpy
  path returns, for sorted, unsorted, repeated, consecutive and sparse positions, 1-d and 2-d arrays,
  many requests at once, and raise the same ``CorruptStoreError`` for every damaged chunk;
- chunks are encoded byte for byte as the numpy code encodes them;
- the compiled loops release the GIL; without the extension hierps warns once and runs numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest
from zarr.storage import LocalStore

from hierps.errors import CorruptStoreError
from hierps.storage import _filter, _merge, _native, _reads
from hierps.storage._arrays import TRAILER, ArrayWriter, _encode_chunks, binding_tags, open_array
from hierps.storage._reads import read_arrays
from hierps.tiers._ssd import SsdTier

core = pytest.importorskip("hierps.storage._native._core", reason="the compiled core was not built")
pytestmark = pytest.mark.skipif(not _native.enabled(), reason="HIERPS_NATIVE=0")

REPO = Path(__file__).resolve().parent.parent


# -- crc32c ----------------------------------------------------------------------------------------
@pytest.fixture(params=[True, False], ids=["crc32-instruction", "table"])
def crc_kind(request):
    if request.param and not core.set_hardware(True) and not core.hardware():
        pytest.skip("this CPU has no crc32 instruction")
    was = core.set_hardware(request.param)
    yield request.param
    core.set_hardware(was)


def test_crc32c_equals_the_package_bit_for_bit(crc_kind):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3 * 8192 * 3 + 64, dtype=np.uint8).tobytes()
    view = memoryview(data)
    lengths = [*range(0, 1100), 4088, 4096, 3 * 256 * 2 + 5, 3 * 8192, 3 * 8192 + 7, 3 * 8192 * 3 + 1]
    for n in lengths:
        start = int(rng.integers(0, 64))  # unaligned starts
        piece = view[start : start + n]
        value = int(rng.integers(0, 1 << 32))
        assert core.crc32c(piece) == crc32c.crc32c(piece), (n, start)
        assert core.crc32c(piece, value) == crc32c.crc32c(piece, value), (n, start, value)
    # Continuing a crc over pieces gives the crc of the whole.
    assert core.crc32c(view[1000:], core.crc32c(view[:1000])) == crc32c.crc32c(data)
    # Any contiguous buffer: bytes, bytearray, numpy arrays of any dtype.
    arr = rng.random((37, 5)).astype(np.float32)
    assert core.crc32c(arr) == crc32c.crc32c(arr.tobytes()) == _native.crc32c(arr)
    assert core.crc32c(bytearray(data[:77])) == crc32c.crc32c(data[:77])


def test_crc32c_refuses_a_strided_buffer():
    with pytest.raises(TypeError, match="contiguous"):
        core.crc32c(np.arange(10, dtype=np.uint8)[::2])


def test_binding_tags_equal_the_numpy_code():
    rng = np.random.default_rng(2)
    chunks = rng.integers(0, 1 << 40, 500)
    crcs = rng.integers(0, 1 << 32, 500).astype(np.uint32)
    out = np.empty(500, np.uint32)
    core.binding_tags(chunks, crcs, 12345, out)
    assert np.array_equal(out, binding_tags(chunks, crcs, 12345))


# -- writing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [0, 4096, 5000])
def test_encoded_chunks_equal_the_numpy_code(stride):
    payloads = np.random.default_rng(3).integers(0, 256, (40, 4088 - 8 * (stride == 5000)), dtype=np.uint8)
    compiled = _encode_chunks(payloads, 1, 17, 99, stride, 5)
    with _native.disabled():
        reference = _encode_chunks(payloads, 1, 17, 99, stride, 5)
    assert compiled[0].shape == reference[0].shape == (40, max(stride, payloads.shape[1] + TRAILER))
    assert np.array_equal(compiled[0], reference[0])
    assert compiled[1] == reference[1] == crc32c.crc32c(payloads.tobytes(), 5)


def test_chunks_encoded_from_rows_apart_equal_those_of_a_copy():
    """A column slice of a wider array (rows 52 bytes apart, 16 of each) encodes as its copy does."""
    wide = np.random.default_rng(7).integers(0, 256, (6 * 33, 52), dtype=np.uint8)
    rows = wide[:, 4:20]
    for native in (True, False):
        with contextlib.nullcontext() if native else _native.disabled():
            apart = _encode_chunks(rows, 33, 3, 77, 4096, 1)
            copied = _encode_chunks(np.ascontiguousarray(rows), 33, 3, 77, 4096, 1)
        assert np.array_equal(apart[0], copied[0]) and apart[1] == copied[1]


@pytest.mark.parametrize("sliced", [False, True])
def test_arrays_are_written_byte_for_byte_as_numpy_writes_them(tmp_path, sliced):
    """Appended in uneven runs (chunks begun by one append, completed by the next), contiguous or as
    a column slice of a wider array: the same file and content checksum as numpy's."""
    wide = np.random.default_rng(4).random((5000, 11)).astype(np.float32)
    data = wide[:, 2:9] if sliced else np.ascontiguousarray(wide[:, 2:9])
    crcs = {}
    for name, ctx in (("compiled", contextlib.nullcontext()), ("numpy", _native.disabled())):
        with ctx:
            writer = ArrayWriter(
                LocalStore(str(tmp_path)), name, (7,), "float32", 33, align=4096, checksum=True, identity="a"
            )
            for a, b in ((0, 10), (10, 40), (40, 4000), (4000, 4001), (4001, 5000)):
                writer.append(data[a:b])
            writer.close()
            crcs[name] = writer.crc
    shard = Path("c", "0", "0")
    assert (tmp_path / "compiled" / shard).read_bytes() == (tmp_path / "numpy" / shard).read_bytes()
    assert crcs["compiled"] == crcs["numpy"] == crc32c.crc32c(np.ascontiguousarray(data).tobytes())


# -- reading ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def arrays(tmp_path_factory):
    """A 2-d array of page-aligned chunks (as a segment's rows) and a 1-d one (as its fences)."""
    root = tmp_path_factory.mktemp("arrays")
    zstore = LocalStore(str(root))
    rng = np.random.default_rng(5)
    rows = rng.random((20_011, 9)).astype(np.float32)
    keys = np.cumsum(rng.integers(1, 1000, 30_000)).astype(np.int64)
    for name, data, chunk_rows, align in (("rows", rows, 113, 4096), ("keys", keys, 500, 1)):
        writer = ArrayWriter(
            zstore, name, data.shape[1:], data.dtype.name, chunk_rows, align=align, identity=name
        )
        writer.append(data)
        writer.close()
    opened = {
        "rows": open_array(zstore, root, "rows", "float32", 2, identity="rows"),
        "keys": open_array(zstore, root, "keys", "int64", 1, identity="keys"),
    }
    return root, opened, {"rows": rows, "keys": keys}


def _positions(n: int) -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(6)
    reversed_in_chunks = np.arange(n) // 113 * 113 + 112 - np.arange(n) % 113
    return {
        "all": None,
        "range": np.arange(n // 3, n // 3 + 2000),
        "one": np.array([n - 1]),
        "sparse": np.arange(0, n, 997),
        "quarter": np.sort(rng.choice(n, n // 4, replace=False)),
        "repeated": np.sort(rng.integers(0, n, 3000)),
        "unsorted": rng.integers(0, n, 3000),
        # In chunk order (of 113 rows) but not sorted within each chunk.
        "reversed within chunks": reversed_in_chunks[reversed_in_chunks < n],
        "empty": np.empty(0, np.int64),
    }


@pytest.mark.parametrize("name", ["rows", "keys"])
def test_reads_return_the_rows_numpy_returns(arrays, name):
    _, opened, data = arrays
    arr, expected = opened[name], data[name]
    for label, pos in _positions(len(expected)).items():
        got = next(read_arrays([(arr, pos)]))
        with _native.disabled():
            reference = next(read_arrays([(arr, pos)]))
        want = expected if pos is None else expected[pos]
        assert got.dtype == reference.dtype == want.dtype, label
        assert got.shape == reference.shape == want.shape, label
        assert np.array_equal(got, want) and np.array_equal(reference, want), label


def test_many_requests_at_once(arrays):
    _, opened, data = arrays
    requests = [(opened["rows"], p) for p in _positions(len(data["rows"])).values()]
    requests += [(opened["keys"], p) for p in _positions(len(data["keys"])).values()]
    got = list(read_arrays(requests))
    with _native.disabled():
        reference = list(read_arrays(requests))
    assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))


@pytest.mark.parametrize("numpy", [False, True], ids=["compiled", "numpy"])
def test_requests_taken_lazily_keep_a_bounded_number_of_bytes_in_flight(arrays, numpy):
    """With ``ahead_bytes`` the requests are drawn from a generator only while those started and not
    yet taken hold less than that; the rows are those of the eager read."""
    _, opened, data = arrays
    arr = opened["rows"]
    wanted = [np.arange(i * 4000, i * 4000 + 3000) for i in range(len(data["rows"]) // 4000)]
    drawn: list[int] = []

    def requests():
        for i, pos in enumerate(wanted):
            drawn.append(i)
            yield arr, pos

    with _native.disabled() if numpy else contextlib.nullcontext():
        chunk_bytes = arr.chunk_bytes * (-(-3000 // arr.chunk_rows) + 1)  # a request's chunks, at most
        results = read_arrays(requests(), ahead_bytes=2 * chunk_bytes)
        for i, got in enumerate(results):
            assert len(drawn) <= i + 3  # this one and at most two more
            assert np.array_equal(got, data["rows"][wanted[i]])
        assert i == len(wanted) - 1 and len(wanted) >= 5
        eager = list(read_arrays([(arr, pos) for pos in wanted]))
    assert all(np.array_equal(a, data["rows"][p]) for a, p in zip(eager, wanted, strict=True))


def _damaged(tmp_path: Path, arrays, damage) -> tuple[str | None, str | None]:
    """The error messages (compiled, numpy) reading every row of a copy of ``rows`` after ``damage``."""
    root, opened, _ = arrays
    arr = opened["rows"]
    copy = tmp_path / "copy"
    copy.mkdir(exist_ok=True)
    shard = copy / "0"
    shard.write_bytes(arr.files[0].read_bytes())
    damage(shard, arr)
    moved = dataclasses.replace(arr, files=(shard,))
    messages = []
    for numpy in (False, True):
        for pos in (None, np.arange(0, arr.shape[0], 50)):
            try:
                with _native.disabled() if numpy else contextlib.nullcontext():
                    next(read_arrays([(moved, pos)]))
            except CorruptStoreError as exc:
                messages.append(str(exc))
            else:
                messages.append(None)
    assert messages[0] == messages[2] and messages[1] == messages[3], messages
    return messages[0], messages[1]


def _flip(at: int):
    def damage(path: Path, arr) -> None:
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x40
        path.write_bytes(bytes(raw))

    return damage


def test_a_damaged_chunk_raises_the_same_error(tmp_path, arrays):
    _, opened, _ = arrays
    arr = opened["rows"]
    # A payload byte of chunk 3, the crc of chunk 10, and the binding tag of chunk 120.
    for at, what in (
        (3 * arr.stride + 100, "crc32c"),
        (10 * arr.stride + arr.payload_bytes + 1, "crc32c"),
        (120 * arr.stride + arr.payload_bytes + 5, "is not the chunk"),
    ):
        whole, sparse = _damaged(tmp_path, arrays, _flip(at))
        assert whole is not None and what in whole and str(tmp_path / "copy" / "0") in whole


def test_several_damaged_chunks_name_the_first_and_the_count(tmp_path, arrays):
    _, opened, _ = arrays
    arr = opened["rows"]

    def damage(path: Path, _arr) -> None:
        for chunk in (150, 7, 80):
            _flip(chunk * arr.stride + 9)(path, arr)
        _flip(2 * arr.stride + arr.payload_bytes + 6)(path, arr)  # a tag: reported only without crc errors

    whole, _ = _damaged(tmp_path, arrays, damage)
    assert whole is not None and "(3 chunk(s) of" in whole


def test_swapped_chunks_fail_their_binding_tags(tmp_path, arrays):
    _, opened, _ = arrays
    arr = opened["rows"]

    def swap(path: Path, _arr) -> None:
        raw = bytearray(path.read_bytes())
        a, b, n = 5 * arr.stride, 40 * arr.stride, arr.chunk_bytes
        raw[a : a + n], raw[b : b + n] = raw[b : b + n], raw[a : a + n]
        path.write_bytes(bytes(raw))

    whole, _ = _damaged(tmp_path, arrays, swap)
    assert whole is not None and "chunk 5 is intact but is not the chunk of 'rows'" in whole
    assert "(2 chunk(s))" in whole


def test_a_truncated_file_raises_the_same_error(tmp_path, arrays):
    def truncate(path: Path, arr) -> None:
        with open(path, "r+b") as f:
            f.truncate(100 * arr.stride + 10)

    whole, sparse = _damaged(tmp_path, arrays, truncate)
    assert whole is not None and "the array was truncated" in whole and "the file ends at" in whole


def test_check_gather_refuses_offsets_outside_its_buffers():
    buf = np.zeros(4096, np.uint8)
    ok = dict(payload=4000, seed=0, chunk_rows=10, row_bytes=400)
    with pytest.raises(ValueError, match="outside the buffer"):
        core.check_gather(buf, np.array([100]), np.array([0]), pos=np.array([0]), out=None, **ok)
    with pytest.raises(ValueError, match="after the last chunk"):
        core.check_gather(buf, np.array([0]), np.array([0]), pos=np.array([10]), out=bytearray(400), **ok)
    with pytest.raises(ValueError, match="not in the chunk"):
        core.check_gather(
            buf,
            np.array([0]),
            np.array([0]),
            pos=np.array([10]),
            out=bytearray(400),
            slot=np.array([0]),
            **ok,
        )
    with pytest.raises(ValueError, match="out holds"):
        core.check_gather(buf, np.array([0]), np.array([0]), pos=np.array([1]), out=bytearray(10), **ok)
    with pytest.raises(TypeError, match="int64"):
        core.check_gather(buf, np.array([0], np.int32), np.array([0]), pos=np.array([1]), out=None, **ok)
    # A chunk of zeros fails its crc32c; reported, not raised.
    assert core.check_gather(buf, np.array([0]), np.array([0]), pos=np.array([3]), out=bytearray(400), **ok)[
        :2
    ] == (
        0,
        1,
    )


# -- the GIL ---------------------------------------------------------------------------------------
def test_the_compiled_loops_release_the_gil():
    """Another Python thread runs while a long crc32c and a long check run in C."""
    big = np.zeros(1 << 28, np.uint8)
    chunks = np.arange(0, len(big) // 4096 - 1, dtype=np.int64)
    at = chunks * 4096

    def work() -> None:
        for _ in range(3):
            core.crc32c(big)
            core.check_gather(big, at, chunks, 4000, 0, np.empty(0, np.int64), 10, 400, None)

    ticks = 0
    worker = threading.Thread(target=work)
    t0 = time.perf_counter()
    worker.start()
    while worker.is_alive():
        ticks += 1
    seconds = time.perf_counter() - t0
    # Holding the GIL, the C calls would leave this thread a few ticks between them at most.
    assert seconds < 0.05 or ticks > 1000, (ticks, seconds)


# -- without the extension -------------------------------------------------------------------------
_WITHOUT = """
import importlib.abc, sys, warnings

class NoCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "hierps.storage._native._core":
            raise ImportError("no compiled core in this test")

sys.meta_path.insert(0, NoCore())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hierps.storage._reads
    import hierps.storage._arrays
    import hierps.storage._native as native
print(native.enabled(), len([w for w in caught if "compiled core" in str(w.message)]))
import numpy as np, tempfile
from pathlib import Path
from zarr.storage import LocalStore
from hierps.storage._arrays import create_array, open_array
from hierps.storage import _reads
from hierps.storage._reads import read_arrays
from hierps.tiers._ssd import SsdTier
root = Path(tempfile.mkdtemp())
data = np.arange(1000, dtype=np.int64)
create_array(LocalStore(str(root)), "a", data, 100, identity="a")
arr = open_array(LocalStore(str(root)), root, "a", "int64", 1, identity="a")
print(np.array_equal(next(read_arrays([(arr, np.arange(0, 1000, 3))])), data[::3]))
"""


def test_without_the_extension_numpy_serves_and_hierps_warns_once():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "plugin"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("HIERPS_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "1", "True"], out.stdout + out.stderr


def test_runs_are_planned_as_numpy_plans_them(arrays):
    """The compiled planner cuts the same runs as the numpy one: gaps, pieces, file boundaries, chunks
    out of order."""
    _, opened, _ = arrays
    base = opened["rows"]
    rng = np.random.default_rng(7)
    n_chunks = base.n_chunks
    # Chunks of 7 to a file, at irregular offsets (gaps below and above _GAP_BYTES, one step back).
    offsets = np.cumsum(rng.choice([4096, 8192, 40 << 10, 300 << 10], n_chunks)) - 4096
    offsets[n_chunks // 2] = 0
    irregular = dataclasses.replace(base, chunks_per_file=7, offsets=offsets, stride=0)
    for arr in (base, irregular):
        for label, pos in _positions(arr.shape[0]).items():
            compiled = _reads._plan(arr, pos)
            compiled.place()
            with _native.disabled():
                reference = _reads._plan(arr, pos)
                reference.place()
            for name in ("at", "run_chunk", "run_file", "run_start", "run_dest"):
                assert np.array_equal(getattr(compiled, name), getattr(reference, name)), (label, name)
            if compiled.fused:
                rows = compiled.pos // arr.chunk_rows
                first_chunk = compiled.chunks[compiled.run_chunk[:-1]]
                assert np.array_equal(compiled.run_row[:-1], np.searchsorted(rows, first_chunk)), label


# -- key filters -----------------------------------------------------------------------------------
def test_filters_are_built_and_probed_as_numpy_does():
    rng = np.random.default_rng(8)
    keys = rng.integers(-(1 << 63), 1 << 62, 50_000)
    probes = np.concatenate([keys[::3], rng.integers(-(1 << 63), 1 << 62, 50_000)])
    for n_words in (1, 7, 9_375):
        built = _filter.bloom_build(keys, n_words)
        with _native.disabled():
            reference = _filter.bloom_build(keys, n_words)
            want = _filter.bloom_may_contain(reference, probes)
        assert np.array_equal(built, reference), n_words
        assert np.array_equal(_filter.bloom_may_contain(built, probes), want), n_words
        assert want[: len(keys[::3])].all()  # no false negatives
    # A filter of blocks of 512 words, the last one shorter.
    filt = rng.integers(0, 1 << 63, 512 * 6 + 100).astype(np.uint64) | rng.integers(0, 1 << 63, 3172).astype(
        np.uint64
    )
    block = rng.integers(0, 7, len(probes))
    got = _filter.blocks_may_contain(filt, probes, block, 512)
    with _native.disabled():
        assert np.array_equal(got, _filter.blocks_may_contain(filt, probes, block, 512))
    assert 0 < got.mean() < 1
    with pytest.raises(ValueError, match="outside the filter"):
        _filter.blocks_may_contain(filt, probes[:3], np.array([0, 9, 1]), 512)


# -- merging sorted runs ---------------------------------------------------------------------------
def _sources(seed: int, k: int, width: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """k sorted sources of (keys, rows) batches over shared keys (duplicates across sources), some
    batches empty, rows as strided views (as a segment's scan gives them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        keys = np.unique(rng.integers(-500, 5000, int(rng.integers(0, 3000))))
        block = rng.random((len(keys), width + 2)).astype(np.float32)
        cuts = np.sort(rng.integers(0, len(keys) + 1, 4))
        out.append([(keys[a:b], block[a:b, 2:]) for a, b in zip([0, *cuts], [*cuts, len(keys)])])
    return out


@pytest.mark.parametrize("k", [1, 2, 5, 17])
def test_runs_are_merged_as_numpy_merges_them(k):
    for seed in range(4):
        for newest_only in (False, True):
            got = list(_merge._merged([iter(s) for s in _sources(seed, k, 5)], 5, newest_only))
            with _native.disabled():
                want = list(_merge._merged([iter(s) for s in _sources(seed, k, 5)], 5, newest_only))
            assert len(got) == len(want)
            for (gk, gr, gs), (wk, wr, ws) in zip(got, want):
                assert np.array_equal(gk, wk) and np.array_equal(gs, ws) and gr.dtype == wr.dtype
                assert np.array_equal(gr.view(np.uint32), wr.view(np.uint32))


def test_rows_outside_an_array_are_refused_alike(arrays):
    _, opened, data = arrays
    arr = opened["keys"]
    for pos in (np.array([3, len(data["keys"])]), np.array([-1, 5, 2]), np.array([7, 2, 40_000])):
        messages = []
        for numpy in (False, True):
            with _native.disabled() if numpy else contextlib.nullcontext():
                with pytest.raises(CorruptStoreError, match="asked of an array of") as err:
                    next(read_arrays([(arr, pos)]))
            messages.append(str(err.value))
        assert messages[0] == messages[1]


# -- matching a segment's rows to a lookup ---------------------------------------------------------
def _overlapping_segments(root: Path) -> tuple[SsdTier, dict[str, np.ndarray]]:
    """Two tables, each written as five overlapping segments (newer rows supersede older ones), and
    sorted requests over more keys than one lookup unit takes, some never written."""
    tier = SsdTier(root, store_id="test")
    requests = {}
    for t, width in enumerate([16, 5]):
        name = f"t{t}"
        tier.add_table(name, width)
        for i in range(5):
            rng = np.random.default_rng(10 * t + i)
            keys = rng.choice(30_000, 4_000 + 1_500 * i, replace=False).astype(np.int64)
            tier.write(name, keys, rng.standard_normal((len(keys), width), dtype=np.float32))
        rng = np.random.default_rng(100 + t)
        requests[name] = np.sort(rng.choice(36_000, 11_000, replace=False)).astype(np.int64)
    return tier, requests


def test_lookups_match_rows_as_numpy_matches_them(tmp_path):
    """Found flags, newest holders and rows of a lookup, compiled and numpy, bit for bit."""
    tier, requests = _overlapping_segments(tmp_path)
    for with_rows in (True, False):
        got = tier._locate(requests, with_rows=with_rows)
        with _native.disabled():
            want = tier._locate(requests, with_rows=with_rows)
        for name, (found, holder, rows) in got.items():
            w_found, w_holder, w_rows = want[name]
            assert np.array_equal(found, w_found) and np.array_equal(holder, w_holder)
            assert 0 < found.sum() < len(found) and len(np.unique(holder[found])) == 5
            if with_rows:
                assert np.array_equal(rows[found].view(np.uint32), w_rows[w_found].view(np.uint32))
            else:
                assert rows.shape == w_rows.shape == (0, 0)
    # All found: the rows are returned as they are, the same as numpy's copy.
    everything = {name: keys[got[name][0]] for name, keys in requests.items()}
    got_all = tier.read_many(everything)
    with _native.disabled():
        want_all = tier.read_many(everything)
    for name, (found, rows) in got_all.items():
        assert found.all() and np.array_equal(rows.view(np.uint32), want_all[name][1].view(np.uint32))


def test_lookups_of_segments_whose_keys_are_held_equal_lookups_that_read_them(tmp_path, monkeypatch):
    """The keys of the segments a tier wrote, held in RAM, give the found flags and newest holders
    (and the chunks that hold the rows) that reading the segments gives: every segment held, none,
    and only some (the older ones let go), with the segments' live counts as they were."""
    tier, requests = _overlapping_segments(tmp_path)
    assert sorted(tier._held_keys) == [(t, s) for t in ("t0", "t1") for _, s in tier.segments(t)]
    assert tier._held_bytes == sum(k.nbytes for k in tier._held_keys.values())
    held = dict(tier._held_keys)
    results = {}
    for case in ("all", "some", "none"):
        tier._held_keys.clear()
        if case != "none":
            kept = list(held.items())[3 if case == "some" else 0 :]
            tier._held_keys.update(kept)
        results[case] = {w: tier._locate(requests, with_rows=w) for w in (True, False)}
    for case in ("all", "some"):
        for w in (True, False):
            for name, (found, holder, rows) in results[case][w].items():
                w_found, w_holder, w_rows = results["none"][w][name]
                assert np.array_equal(found, w_found) and np.array_equal(holder, w_holder), (case, w, name)
                if w:
                    assert np.array_equal(rows[found].view(np.uint32), w_rows[w_found].view(np.uint32))
    # Past the allowance, the oldest segments' keys are let go as newer ones come.
    tier._held_keys.clear()
    tier._held_keys.update(held)
    live = {name: tier.num_rows(name) for name in requests}
    monkeypatch.setattr("hierps.tiers._ssd._HELD_KEYS_BYTES", 6_000 * 8)
    keys = np.arange(5_000, dtype=np.int64)
    tier.write("t1", keys, np.zeros((len(keys), 5), np.float32))
    assert list(tier._held_keys) == [tier.segments("t1")[-1]]
    assert tier._held_bytes == keys.nbytes
    assert tier.num_rows("t1") == len(np.union1d(keys, tier.keys("t1"))) and tier.num_rows("t0") == live["t0"]
    tier.close()


def test_find_sorted_equals_numpy():
    """Positions (numpy's searchsorted, clamped) and found flags of keys in sorted keys: ascending,
    in any order, repeated, outside the range, against no keys at all."""
    rng = np.random.default_rng(5)
    extremes = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], np.int64)
    for n in (0, 1, 7, 1_000, 40_000):
        stored = np.unique(np.concatenate([rng.integers(-(10**6), 10**6, n), extremes[: min(n, 4)]]))
        for m in (0, 1, 33, 5_000):
            mixed = np.concatenate(
                [
                    rng.choice(stored, m // 2) if len(stored) else [],
                    rng.integers(-(2 * 10**6), 2 * 10**6, m - m // 2),
                ]
            )
            mixed = np.concatenate([mixed.astype(np.int64), extremes])
            for keys in (np.sort(mixed), mixed, np.repeat(np.sort(mixed), 2)):
                found, at = np.empty(len(keys), bool), np.empty(len(keys), np.int64)
                hits = core.find_sorted(stored, keys, found, at)
                want_at = np.minimum(np.searchsorted(stored, keys), max(len(stored) - 1, 0))
                want = stored[want_at] == keys if len(stored) else np.zeros(len(keys), bool)
                assert np.array_equal(at, want_at) and np.array_equal(found, want) and hits == want.sum()
    with pytest.raises(ValueError, match="one position and one bool per key"):
        core.find_sorted(stored, stored, np.empty(1, bool), np.empty(len(stored), np.int64))
    with pytest.raises(TypeError, match="int64"):
        core.find_sorted(
            stored.astype(np.int32), stored, np.empty(len(stored), bool), np.empty(len(stored), np.int64)
        )


def test_index_add_rows_adds_the_floats_of_torch_index_add():
    """Rows added into rows, the entries in order, as torch's CPU ``index_add_`` adds them, bit for
    bit (repeats, signed zeros, infinities, a start that is not zero, widths that fill no vector);
    a row out of range is refused before anything is added."""
    import torch

    from hierps.training._batchplan import index_add_rows

    rng = np.random.default_rng(9)
    for n, u, width in ((0, 4, 16), (1, 1, 1), (5_000, 37, 16), (20_000, 5_000, 3), (3_000, 700, 129)):
        rows = torch.from_numpy(rng.integers(0, u, n))
        values = torch.from_numpy(rng.standard_normal((n, width)).astype(np.float32) * 1e3)
        values[::7] = -0.0
        values[5::11, 0] = float("inf")
        start = torch.from_numpy(rng.standard_normal((u, width)).astype(np.float32))
        want = start.clone().index_add_(0, rows, values)
        got = index_add_rows(start.clone(), rows, values)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    dst = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="row 4 of entry 1 is out of range for 4 rows"):
        core.index_add_rows(dst, np.array([0, 4], np.int64), np.ones((2, 2), np.float32), 2)
    assert not dst.any()
    with pytest.raises(ValueError, match="float32 rows"):
        core.index_add_rows(dst, np.array([0], np.int64), np.ones((2, 2), np.float32), 2)


def test_match_rows_refuses_what_does_not_fit():
    block = np.zeros((4, 2 + 3), np.float32)
    keys, which = np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64)
    found, holder, rows = np.zeros(4, bool), np.zeros(4, np.int64), np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="block rows are not 8 bytes of key"):
        _native.match_rows(block, 4, keys, which, found, holder, 0, rows)
    with pytest.raises(ValueError, match="one found flag, holder and row per key"):
        _native.match_rows(block, 3, keys, which, found[:3], holder, 0, rows)
    with pytest.raises(ValueError, match=r"which\[1\] is not a position among the 4 keys"):
        _native.match_rows(block, 3, keys, np.array([0, 9], np.int64), found, holder, 0, rows)
    assert not found.any() and not holder.any()  # refused before anything was written
    block_keys = np.ndarray((4,), np.int64, block, 0, (block.strides[0],))
    block_keys[:] = [0, 1, 2, 3]
    block[:, 2:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    found[2] = True  # a newer segment already gave key 2
    assert _native.match_rows(block, 3, keys, which, found, holder, 7, rows) == 3
    assert found.all() and holder.tolist() == [7, 7, 0, 7] and rows[2].tolist() == [0, 0, 0]
    assert rows[3].tolist() == [9, 10, 11]


def test_insert_sorted_equals_numpy():
    """Sorted keys with sorted new ones added (the RAM tier's index): np.insert at np.searchsorted's
    places, keys and slots alike, new keys before, between and after the held ones, either side empty."""
    rng = np.random.default_rng(8)
    extremes = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], np.int64)
    for n in (0, 1, 9, 3_000, 100_000):
        for m in (0, 1, 40, 2_000):
            pool = np.unique(np.concatenate([rng.integers(-(10**7), 10**7, n + m), extremes]))
            pool = rng.permutation(pool)
            keys, new = np.sort(pool[:n]), np.sort(pool[n : n + m])
            slots, new_slots = rng.integers(0, 10**9, len(keys)), rng.integers(0, 10**9, len(new))
            out_keys, out_slots = (
                np.empty(len(keys) + len(new), np.int64),
                np.empty(len(keys) + len(new), np.int64),
            )
            core.insert_sorted(keys, slots, new, new_slots, out_keys, out_slots)
            at = np.searchsorted(keys, new)
            assert np.array_equal(out_keys, np.insert(keys, at, new))
            assert np.array_equal(out_slots, np.insert(slots, at, new_slots))
    with pytest.raises(ValueError, match="n \\+ m entries out"):
        core.insert_sorted(keys, slots, new, new_slots, out_keys[:-1], out_slots)
    with pytest.raises(TypeError, match="int64"):
        core.insert_sorted(keys.astype(np.int32), slots, new, new_slots, out_keys, out_slots)
