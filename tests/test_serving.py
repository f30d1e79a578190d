"""Serving from exports (hierps.serving): rows read from disk on demand equal the store's, new deltas
are followed one whole generation at a time, and every kind of damage to an export is reported with
the file it concerns, never served as rows.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from zarr.storage import LocalStore

import hierps
from hierps import serving
from hierps.errors import ConfigError, CorruptStoreError, StoreClosedError, StoreFormatError, StoreFullError
from hierps.lifecycle._export import export_store
from hierps.serving._cache import WAYS, RowCache
from hierps.storage import _arrays
from hierps.storage._arrays import ArrayWriter
from hierps.storage._export_format import PAGE, chunk_rows_for, key_align, read_manifest

ADAGRAD = {"type": "adagrad", "params": {"lr": 0.2}}
DIMS = {"t": 4, "u": 8}
UNKNOWN = np.array([10**6, 10**6 + 1, -5, 2**62], np.int64)


def _target(ids: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.sin(ids.to(torch.float32)[:, None] * torch.arange(1, dim + 1, dtype=torch.float32) * 0.37)


def _train_pass(
    store: hierps.Store, embs: dict[str, hierps.Embedding], rng: np.random.Generator, hot: int
) -> None:
    """One pass of two mini-batches: hot keys often, keys up to 3000 now and then."""
    batches = [
        {
            name: torch.from_numpy(
                np.where(rng.random(40) < 0.7, rng.integers(0, hot, 40), rng.integers(0, 3000, 40))
            )
        }
        for name in embs
        for _ in range(2)
    ]
    merged = [{k: v for b in batches[i::2] for k, v in b.items()} for i in range(2)]
    with store.run_pass(merged):
        for batch in merged:
            loss = sum(((embs[n](ids) - _target(ids, DIMS[n])) ** 2).sum() for n, ids in batch.items())
            loss.backward()
            store.step()


def _stage(store: hierps.Store, embs: dict[str, hierps.Embedding], seed: int) -> int:
    """Train four passes (each stage on other hot keys), deleting rows unseen for two passes after the
    second, and write 2000 rows (of keys 3000 + 1000 * seed on, half of them the last stage's, whose
    other half the deletion took); a checkpoint."""
    rng = np.random.default_rng(seed)
    for p in range(4):
        _train_pass(store, embs, rng, hot=(60, 30, 60, 90)[seed % 4])
        if p == 1:
            store.shrink(ttl_passes=2)
            keys = np.arange(3000 + 1000 * (seed % 4), 5000 + 1000 * (seed % 4))
            for name, dim in DIMS.items():
                store.write(name, keys, rng.standard_normal((len(keys), dim), dtype=np.float32))
    return store.checkpoint(f"stage{seed}")


def _open_store(path: Path) -> tuple[hierps.Store, dict[str, hierps.Embedding]]:
    store = hierps.Store(path, memory_budget="4KiB", device="cpu", optimizer=ADAGRAD, keep_checkpoints=8)
    embs = {
        "t": hierps.Embedding(None, DIMS["t"], store=store, name="t", eviction={"ttl_passes": 50}),
        "u": hierps.Embedding(
            None, DIMS["u"], store=store, name="u", admission={"min_count": 2, "unadmitted": "zeros"}
        ),
    }
    return store, embs


def _probe(seen: set[int]) -> np.ndarray:
    return np.concatenate([np.array(sorted(seen), np.int64), UNKNOWN])


def _expected(store: hierps.Store, probe: np.ndarray) -> dict[str, np.ndarray]:
    return {name: store.lookup(name, torch.from_numpy(probe)).numpy().copy() for name in DIMS}


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Exports ``full0..2`` and ``delta1..2`` of a store trained in three stages with deletions; the
    rows the store served at each stage for every key ever stored and a few never stored."""
    root = tmp_path_factory.mktemp("history")
    store, embs = _open_store(root / "store")
    out = root / "exports"
    expected, ckpts = [], []
    seen: set[int] = set(range(8000))
    with store:
        for stage in range(3):
            ckpts.append(_stage(store, embs, stage))
            expected.append(_expected(store, _probe(seen)))
            store.export(out / f"full{stage}")
            if stage:
                store.export(out / f"delta{stage}", since=ckpts[-2])
    return {"out": out, "expected": expected, "probe": _probe(seen), "ckpts": ckpts}


def _copy(history: dict[str, Any], tmp_path: Path, *names: str) -> Path:
    for name in names:
        shutil.copytree(history["out"] / name, tmp_path / name)
    return tmp_path


# -- serving equals the store ----------------------------------------------------------------------
@pytest.mark.parametrize("cache_bytes", [0, "3KiB", serving.DEFAULT_CACHE_BYTES])
def test_base_plus_deltas_serve_what_the_store_served(history, cache_bytes):
    out, probe = history["out"], history["probe"]
    d1 = json.loads((out / "delta1" / "manifest.json").read_text())
    assert d1["tables"]["t"]["deleted"] > 0 and 0 < d1["tables"]["t"]["rows"]
    with serving.open(
        out / "full0", deltas=[out / "delta1", out / "delta2"], cache_bytes=cache_bytes
    ) as tables:
        assert tables.checkpoint == history["ckpts"][2] and tables.tables == DIMS
        for _ in range(2):  # the second time from the cache (where it has room)
            for name in DIMS:
                np.testing.assert_array_equal(tables.lookup(name, probe), history["expected"][2][name])
        # Any order, duplicates, shapes, torch in and out.
        rng = np.random.default_rng(0)
        ids = rng.choice(probe, size=(7, 33))
        want = {n: history["expected"][2][n] for n in DIMS}
        order = np.argsort(probe)
        at = order[np.searchsorted(probe[order], ids)]
        for name in DIMS:
            np.testing.assert_array_equal(tables.lookup(name, ids), want[name][at])
            got = tables.lookup(name, torch.from_numpy(ids))
            assert isinstance(got, torch.Tensor) and got.shape == (7, 33, DIMS[name])
            np.testing.assert_array_equal(got.numpy(), want[name][at])
        full = serving.open(out / "full2")
        for name in DIMS:
            np.testing.assert_array_equal(tables.keys(name), full.keys(name))
            assert tables.num_rows(name) == full.num_rows(name) == len(full.keys(name))
        info = tables.cache_info()
        assert info["bytes"] <= parse(cache_bytes)
        if info["capacity_rows"]:
            assert info["hits"] > 0


def parse(size: int | str) -> int:
    return hierps.parse_size(size, "cache_bytes")


def test_unknown_and_deleted_keys_read_as_the_manifest_says(history):
    out, probe, expected = history["out"], history["probe"], history["expected"][2]
    tables = serving.open(out / "full0", deltas=[out / "delta1", out / "delta2"])
    unknown = np.isin(probe, tables.keys("u"), invert=True)
    assert unknown.sum() > len(UNKNOWN)  # deleted and never admitted keys too
    np.testing.assert_array_equal(tables.lookup("u", probe[unknown]), 0.0)  # "u" reads unknown keys as zeros
    zeros = serving.open(out / "full0", deltas=[out / "delta1", out / "delta2"], unknown="zeros")
    gone = np.isin(probe, tables.keys("t"), invert=True)
    np.testing.assert_array_equal(zeros.lookup("t", probe[gone]), 0.0)
    assert np.all(tables.lookup("t", probe[gone]) != 0.0)  # "t": the initializer's rows
    np.testing.assert_array_equal(tables.lookup("t", probe[gone]), expected["t"][gone])


def test_open_reads_no_rows(history, tmp_path):
    """Open reads the manifest, fences and filters only: a base whose every chunk of values is
    unreadable still opens (the damage shows at the first lookup of a row)."""
    path = _copy(history, tmp_path, "full2") / "full2"
    values = path / "t" / "values" / "c" / "0" / "0"
    data = bytearray(values.read_bytes())
    index_bytes = 16 * (len(data) // PAGE) + 4
    data[: len(data) - index_bytes - 64] = b"\xff" * (len(data) - index_bytes - 64)
    values.write_bytes(bytes(data))
    tables = serving.open(path)
    assert 0 < tables.index_bytes / tables.num_rows("t") < 4  # tiny tables: a filter word per table at least
    with pytest.raises(CorruptStoreError, match=re.escape(str(values)) + ": chunk failed its crc32c"):
        tables.lookup("t", tables.keys("t"))


def test_closed_tables_refuse_lookups(history):
    tables = serving.open(history["out"] / "full0")
    tables.close()
    with pytest.raises(StoreClosedError):
        tables.lookup("t", [1])


def test_bad_arguments(history, tmp_path):
    out = history["out"]
    with pytest.raises(ConfigError, match="verify: expected one of"):
        serving.open(out / "full0", verify="some")
    with pytest.raises(ConfigError, match="cache_bytes"):
        serving.open(out / "full0", cache_bytes="lots")
    with pytest.raises(ConfigError, match="only a serving directory"):
        serving.open(out / "full0", follow=1.0)
    with pytest.raises(ConfigError, match="holds no full export"):
        serving.open(tmp_path)
    with pytest.raises(ConfigError, match="is a delta .since checkpoint"):
        serving.open(out / "delta1")


def test_row_cache_keeps_the_recent_rows_of_one_generation():
    cache = RowCache(2 * WAYS * (4 * 2 + 16), dim=2, generation=1)  # two sets of 8 rows of dim 2
    assert cache.capacity == 16 and cache.nbytes == 2 * WAYS * (4 * 2 + 16)
    ids = np.arange(1000, dtype=np.int64)
    same = ids[cache._set_of(ids) == 0][: WAYS + 1]  # nine keys of one set
    rows = np.stack([same, -same], axis=1).astype(np.float32)
    cache.put(same[:WAYS], rows[:WAYS], generation=1)
    hit, got = cache.get(same[1:WAYS], generation=1)  # all but the first used again
    assert hit.all()
    np.testing.assert_array_equal(got, rows[1:WAYS])
    cache.put(same[WAYS:], rows[WAYS:], generation=1)  # a ninth: the least recently used goes
    hit, got = cache.get(same, generation=1)
    np.testing.assert_array_equal(hit, [False] + [True] * WAYS)
    np.testing.assert_array_equal(got, rows[1:])
    assert not cache.get(same, generation=2)[0].any()  # rows of generation 1 only
    cache.put(same[:1], rows[:1], generation=2)  # ignored: not the cache's generation
    cache.advance(2, touched=same[1:3])
    np.testing.assert_array_equal(
        cache.get(same, generation=2)[0], [False, False, False] + [True] * (WAYS - 2)
    )
    cache.advance(3, touched=None)
    assert not cache.get(same, generation=3)[0].any()
    assert RowCache(0, dim=4).capacity == 0 and not RowCache(0, dim=4).get(same, 0)[0].any()


# -- exports: written streaming, atomically ---------------------------------------------------------
def test_export_arrays_are_plain_zarr_with_the_documented_layout(history):
    path = history["out"] / "delta1"
    manifest = json.loads((path / "manifest.json").read_text())
    g = zarr.open_group(str(path), mode="r")
    for name, dim in DIMS.items():
        meta = manifest["tables"][name]
        keys, values, deleted = g[name]["keys"][:], g[name]["values"][:], g[name]["deleted"][:]
        assert keys.shape == (meta["rows"],) and values.shape == (meta["rows"], dim)
        assert deleted.shape == (meta["deleted"],)
        assert np.all(keys[1:] > keys[:-1]) and np.all(deleted[1:] > deleted[:-1])
        assert not np.isin(deleted, keys).any()
        rows = chunk_rows_for(dim)
        np.testing.assert_array_equal(g[name]["fences"][:], keys[::rows])
        assert g[name]["filter"].dtype == np.uint64
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    assert manifest["crc32"] == zlib.crc32(json.dumps(body, sort_keys=True, indent=1).encode())


def test_stale_temp_directories_are_removed_by_the_next_export_or_open(history, tmp_path):
    out = history["out"]
    dead = _dead_pid()
    for name in ("full9", "other"):
        (tmp_path / f".{name}.tmp-{dead}" / "t").mkdir(parents=True)
    live = tmp_path / f".busy.tmp-{os.getppid()}"
    live.mkdir()
    shutil.copytree(out / "full0", tmp_path / "full0")
    serving.open(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "full0"]
    (tmp_path / f".x.tmp-{dead}").mkdir()
    with hierps.Store(tmp_path / "store", device="cpu") as store:
        store.table("t", 4)
        store.write("t", [1, 2], np.ones((2, 4), np.float32))
        store.checkpoint()
        store.export(tmp_path / "exp")
    assert not (tmp_path / f".x.tmp-{dead}").exists() and live.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_full_disk_during_export(tmp_path, monkeypatch):
    with hierps.Store(tmp_path / "store", device="cpu") as store:
        store.table("t", 4)
        store.write("t", np.arange(5000), np.ones((5000, 4), np.float32))
        store.checkpoint()
        calls = {"n": 0}
        real = _arrays._write_all

        def full(fd: int, data: np.ndarray) -> None:
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, data)

        monkeypatch.setattr(_arrays, "_write_all", full)
        with pytest.raises(
            StoreFullError, match=r"\.exp\.tmp-\d+: no space left on the device while writing"
        ) as info:
            store.export(tmp_path / "exp")
        assert info.value.errno == errno.ENOSPC and "export again" in str(info.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
        monkeypatch.setattr(_arrays, "_write_all", real)
        store.export(tmp_path / "exp")
    np.testing.assert_array_equal(serving.open(tmp_path / "exp").lookup("t", [0, 4999]), 1.0)


# -- follow mode ---------------------------------------------------------------------------------------
@pytest.fixture
def live(tmp_path: Path) -> dict[str, Any]:
    """A store, trained one stage and exported (base ``full0``) into a serving directory."""
    store, embs = _open_store(tmp_path / "store")
    ckpt = _stage(store, embs, 0)
    store.export(tmp_path / "serve" / "full0")
    yield {"store": store, "embs": embs, "serve": tmp_path / "serve", "ckpts": [ckpt]}
    store.close()


def _next_delta(live: dict[str, Any], seed: int, name: str | None = None) -> Path:
    store = live["store"]
    live["ckpts"].append(_stage(store, live["embs"], seed))
    path = live["serve"] / (name or f"delta{seed}")
    store.export(path, since=live["ckpts"][-2])
    return path


def test_refresh_serves_new_deltas(live):
    tables = serving.open(live["serve"])
    probe = _probe(set(range(8000)))
    assert tables.refresh() is False and tables.generation == 1
    _next_delta(live, 1)
    _next_delta(live, 2)
    tables.lookup("t", probe)  # fill the cache with rows of generation 1
    assert tables.refresh() is True
    assert tables.generation == 2 and tables.checkpoint == live["ckpts"][-1]
    assert [p.name for p in tables.applied] == ["full0", "delta1", "delta2"]
    for _ in range(2):
        for name, rows in _expected(live["store"], probe).items():
            np.testing.assert_array_equal(tables.lookup(name, probe), rows)
    # A new base starts a new chain.
    live["store"].export(live["serve"] / "full9")
    assert tables.refresh() is True and [p.name for p in tables.applied] == ["full9"]
    np.testing.assert_array_equal(tables.lookup("t", probe), _expected(live["store"], probe)["t"])


def test_explicit_deltas_refresh(live):
    tables = serving.open(live["serve"] / "full0")
    delta = _next_delta(live, 1)
    assert tables.refresh([delta]) is True and tables.checkpoint == live["ckpts"][-1]
    with pytest.raises(ConfigError, match="Pass deltas in order"):
        tables.refresh([delta])


DAMAGE = ["values chunk", "keys chunk", "deleted chunk", "missing values", "missing manifest field"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_delta_is_refused_and_the_previous_generation_keeps_serving(live, damage):
    probe = _probe(set(range(8000)))
    tables = serving.open(live["serve"])
    before = _expected(live["store"], probe)
    delta = _next_delta(live, 1)
    _damage_delta(delta, damage)
    with pytest.raises((CorruptStoreError, StoreFormatError), match=re.escape(str(delta))):
        tables.refresh()
    assert tables.generation == 1 and tables.checkpoint == live["ckpts"][0]
    for name, rows in before.items():
        np.testing.assert_array_equal(tables.lookup(name, probe), rows)
    shutil.rmtree(delta)  # the delta written again, whole: served
    live["store"].export(delta, since=live["ckpts"][0])
    assert tables.refresh() is True
    for name, rows in _expected(live["store"], probe).items():
        np.testing.assert_array_equal(tables.lookup(name, probe), rows)


def _damage_delta(delta: Path, damage: str) -> None:
    if damage == "values chunk":
        _flip(delta / "t" / "values" / "c" / "0" / "0", 10)
    elif damage == "keys chunk":
        _flip(delta / "t" / "keys" / "c" / "0", 3)
    elif damage == "deleted chunk":
        _flip(delta / "t" / "deleted" / "c" / "0", 3)
    elif damage == "missing values":
        (delta / "u" / "values" / "c" / "0" / "0").unlink()
    else:
        _edit_manifest(delta, lambda m: m["tables"]["t"].pop("total_rows"), fix_crc=True)


def test_follow_polls_and_survives_a_damaged_delta(live):
    """Each export is written whole before the poll waited for begins, so that poll sees it: no
    waiting on the clock."""
    with serving.open(live["serve"], follow=0.02) as tables:
        _next_delta(live, 1)
        assert tables.wait_for_poll(timeout=600)
        assert tables.generation == 2 and tables.checkpoint == live["ckpts"][-1]
        assert tables.refresh_error is None
        delta = _next_delta(live, 2)
        _flip(delta / "t" / "values" / "c" / "0" / "0", 10)
        assert tables.wait_for_poll(timeout=600)
        assert isinstance(tables.refresh_error, CorruptStoreError) and tables.generation == 2
        shutil.rmtree(delta)
        live["store"].export(delta, since=live["ckpts"][-2])
        assert tables.wait_for_poll(timeout=600)
        assert tables.generation == 3 and tables.refresh_error is None
        probe = _probe(set(range(8000)))
        np.testing.assert_array_equal(tables.lookup("t", probe), _expected(live["store"], probe)["t"])
    assert not tables.wait_for_poll(timeout=600)  # closed: no poll will come


@pytest.mark.parametrize("cache_bytes", ["2KiB", serving.DEFAULT_CACHE_BYTES])
def test_a_lookup_never_sees_half_a_delta(tmp_path, cache_bytes):
    """A reader looping lookups while deltas are written and applied: every result is the rows of
    exactly one generation. Each delta rewrites every row of the probe but a fifth, which it
    deletes (another fifth each time), so a result mixing two generations matches none. After each
    refresh the writer waits for a lookup that began after it (so each generation is read)."""
    keys = np.arange(0, 400, dtype=np.int64)
    store = hierps.Store(tmp_path / "store", device="cpu", keep_checkpoints=4)
    store.table("t", 4)
    store.write("t", keys, np.zeros((len(keys), 4), np.float32))
    ckpts = [store.checkpoint()]
    store.export(tmp_path / "serve" / "base")
    expected = [_expected_t(store, keys)]
    tables = serving.open(tmp_path / "serve", cache_bytes=cache_bytes)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    looked = threading.Condition()

    def read() -> None:
        rng = np.random.default_rng(1)
        try:
            while not stop.is_set():
                order = rng.permutation(len(keys))[: rng.integers(1, len(keys) + 1)]
                seen.append((order, tables.lookup("t", keys[order]).copy()))
                with looked:
                    looked.notify_all()
        except BaseException as exc:  # reported below
            errors.append(exc)
            with looked:
                looked.notify_all()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for gen in range(1, 9):
            alive = keys[(keys + gen) % 5 != 0]
            for _ in range(2):  # the other fifth is unseen for two passes: shrink deletes it
                with store.run_pass({"t": torch.from_numpy(alive)}):
                    pass
            store.write("t", alive, np.full((len(alive), 4), gen, np.float32))
            store.shrink("t", ttl_passes=1)
            ckpts.append(store.checkpoint())
            store.export(tmp_path / "serve" / f"d{gen}", since=ckpts[-2])
            expected.append(_expected_t(store, keys))
            assert tables.refresh() is True
            with looked:  # the lookup under way may have begun before: the one after it did not
                target = len(seen) + 2
                assert looked.wait_for(lambda n=target: len(seen) >= n or errors, timeout=600)
    finally:
        stop.set()
        reader.join()
        store.close()
    assert not errors, errors
    assert tables.generation == 9 and len(seen) > 8
    for gen in range(1, 9):  # each generation's deletions show (as the initializer's rows)
        assert np.sum(expected[gen][:, 0] != gen) == len(keys) // 5
    generations = set()
    for order, rows in seen:
        matches = [g for g, e in enumerate(expected) if np.array_equal(rows, e[order])]
        assert matches, "a lookup returned rows of no single generation"
        generations.update(matches)
    assert set(range(1, 9)) <= generations


def _expected_t(store: hierps.Store, keys: np.ndarray) -> np.ndarray:
    return store.lookup("t", torch.from_numpy(keys)).numpy().copy()


# -- damaged and foreign exports ---------------------------------------------------------------------
def _flip(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_manifest(export: Path, edit, fix_crc: bool) -> None:
    manifest = json.loads((export / "manifest.json").read_text())
    edit(manifest)
    if fix_crc:
        body = {k: v for k, v in manifest.items() if k != "crc32"}
        manifest["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, indent=1).encode())
    (export / "manifest.json").write_text(json.dumps(manifest))


def _serve_all(export: Path, deltas: list[Path] | None = None) -> None:
    tables = serving.open(export, deltas=deltas)
    for name in tables.tables:
        tables.lookup(name, tables.keys(name))
        tables.lookup(name, np.arange(-10, 8000))


ARRAY_FILES = {
    "keys": "keys/c/0",
    "values": "values/c/0/0",
    "fences": "fences/c/0",
    "deleted": "deleted/c/0",
    "deleted_fences": "deleted_fences/c/0",
    "filter": "filter/c/0",
}


@pytest.mark.parametrize("array", list(ARRAY_FILES))
@pytest.mark.parametrize("verify", ["none", "deltas"])
def test_a_flipped_byte_in_any_array_is_reported(history, tmp_path, array, verify):
    root = _copy(history, tmp_path, "full1", "delta2")
    file = root / "delta2" / "t" / ARRAY_FILES[array]
    _flip(file, 6)
    with pytest.raises(CorruptStoreError, match=re.escape(str(root / "delta2" / "t"))):
        tables = serving.open(root / "full1", deltas=[root / "delta2"], verify=verify)
        tables.lookup("t", history["probe"])


@pytest.mark.parametrize("array", ["keys", "values", "fences", "filter"])
def test_a_flipped_byte_in_a_base_is_reported_when_read(history, tmp_path, array):
    root = _copy(history, tmp_path, "full2")
    _flip(root / "full2" / "t" / ARRAY_FILES[array], 6)
    with pytest.raises(CorruptStoreError, match=re.escape(str(root / "full2" / "t"))):
        _serve_all(root / "full2")


@pytest.mark.parametrize("array", ["keys", "values", "deleted"])
def test_truncated_and_missing_chunk_files(history, tmp_path, array):
    root = _copy(history, tmp_path, "full1", "delta2")
    file = root / "delta2" / "t" / ARRAY_FILES[array]
    file.write_bytes(file.read_bytes()[:-9])
    with pytest.raises(CorruptStoreError, match=re.escape(str(file)) + ".*(truncated|shard index)"):
        _serve_all(root / "full1", [root / "delta2"])
    file.unlink()
    with pytest.raises(CorruptStoreError, match=re.escape(str(file)) + ": chunk missing"):
        _serve_all(root / "full1", [root / "delta2"])


def test_a_swapped_chunk_is_caught_by_the_fences(history, tmp_path):
    """Every chunk's checksum passes, but a chunk of keys holds another chunk's keys."""
    root = _copy(history, tmp_path, "full2")
    keys_dir = root / "full2" / "t" / "keys"
    keys = zarr.open_array(str(keys_dir), mode="r")[:]
    rows = chunk_rows_for(DIMS["t"])
    assert len(keys) > 2 * rows
    keys[:rows] = keys[rows : 2 * rows]  # chunk 0 now holds chunk 1's keys
    _rewrite(root / "full2", "t", "keys", keys, rows, key_align(rows))
    with pytest.raises(CorruptStoreError, match="disagree with the fences"):
        _serve_all(root / "full2")


def test_files_of_another_export_copied_over_are_refused(history, tmp_path):
    """Two exports of the same checkpoint hold the same bytes in every chunk: what one export's
    array, or its manifest, copied over the other's gets is refused, not served."""
    root = _copy(history, tmp_path, "full1", "full2")
    export_store(
        history["out"].parent / "store", root / "again", checkpoint=read_manifest(root / "full2").checkpoint
    )
    ids = serving.open(root / "full2").keys("t")[:50]
    shutil.rmtree(root / "full2" / "t" / "values")
    shutil.copytree(root / "again" / "t" / "values", root / "full2" / "t" / "values")
    with pytest.raises(CorruptStoreError, match="values/c/0/0: chunk .* is not the chunk of"):
        serving.open(root / "full2").lookup("t", ids)
    with pytest.raises(CorruptStoreError, match="is not the chunk of"):
        serving.open(root / "full2", verify="all")
    # Another export's manifest copied over: the arrays are not what it names (same shapes, other
    # export: the binding tags; an older checkpoint's: its shapes already).
    manifest = root / "again" / "manifest.json"
    for other, message in (("full2", "is not the chunk of"), ("full1", "shape")):
        shutil.copy(root / other / "manifest.json", manifest)
        with pytest.raises(CorruptStoreError, match=message):
            serving.open(root / "again")


def test_unsorted_keys_are_refused(history, tmp_path):
    root = _copy(history, tmp_path, "full2")
    keys = zarr.open_array(str(root / "full2" / "t" / "keys"), mode="r")[:]
    keys[[3, 4]] = keys[[4, 3]]
    rows = chunk_rows_for(DIMS["t"])
    _rewrite(root / "full2", "t", "keys", keys, rows, key_align(rows))
    with pytest.raises(CorruptStoreError, match="not sorted and unique"):
        serving.open(root / "full2").lookup("t", keys[:10])
    with pytest.raises(CorruptStoreError, match="not sorted and unique"):
        serving.open(root / "full2", verify="all")


def _rewrite(export: Path, table: str, array: str, data: np.ndarray, chunk_rows: int, align: int) -> None:
    """Write ``data`` as the array with intact chunk checksums and a manifest that agrees with it: what a
    faulty writer would leave."""
    shutil.rmtree(export / table / array)
    out = ArrayWriter(
        LocalStore(str(export)),
        f"{table}/{array}",
        data.shape[1:],
        data.dtype.name,
        chunk_rows,
        align=align,
        checksum=True,
        identity=read_manifest(export).tables[table].identity(array),
    )
    out.append(data)
    out.close()

    def edit(m: dict[str, Any]) -> None:
        m["tables"][table]["checks"][array] = out.crc

    _edit_manifest(export, edit, fix_crc=True)


def _more_rows(meta: dict[str, Any]) -> None:
    meta.update(rows=meta["rows"] + 1, total_rows=meta["rows"] + 1)


MANIFEST_EDITS = {
    "dim": (lambda m: m["tables"]["t"].update(dim=5), "values has shape"),
    "huge dim": (lambda m: m["tables"]["t"].update(dim=10**12), r"tables\.t\.dim: expected an int"),
    "rows": (lambda m: _more_rows(m["tables"]["t"]), "keys has shape"),
    "negative rows": (lambda m: m["tables"]["t"].update(rows=-1), r"tables\.t\.rows: expected an int"),
    "rows as text": (lambda m: m["tables"]["t"].update(rows="12"), r"tables\.t\.rows: expected an int"),
    "table name": (lambda m: m["tables"].update({"../x": m["tables"].pop("t")}), "plain directory names"),
    "unknown": (lambda m: m["tables"]["t"].update(unknown="mean"), r"tables\.t\.unknown: expected one of"),
    "initializer": (
        lambda m: m["tables"]["t"].update(initializer={"type": "pickle"}),
        r"tables\.t\.initializer",
    ),
    "checks": (
        lambda m: m["tables"]["t"]["checks"].pop("filter"),
        r"tables\.t\.checks: expected a check of each",
    ),
    "a check": (lambda m: m["tables"]["t"]["checks"].update(fences=7), "content of fences does not match"),
    "tables": (lambda m: m.update(tables=[1]), "tables: expected an object"),
    "checkpoint": (lambda m: m.update(checkpoint=None), "checkpoint: expected an int"),
}


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_tampered_manifest_fields_are_refused(history, tmp_path, edit):
    root = _copy(history, tmp_path, "full2")
    change, message = MANIFEST_EDITS[edit]
    original = (root / "full2" / "manifest.json").read_bytes()
    _edit_manifest(root / "full2", change, fix_crc=False)
    with pytest.raises(
        CorruptStoreError, match=re.escape(str(root / "full2" / "manifest.json")) + ": checksum mismatch"
    ):
        serving.open(root / "full2")
    (root / "full2" / "manifest.json").write_bytes(original)
    _edit_manifest(root / "full2", change, fix_crc=True)
    with pytest.raises(CorruptStoreError, match=message):
        serving.open(root / "full2")


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        (
            b'{"format": "hierps-export", "format_version": 1}',
            StoreFormatError,
            "format version 1.*Export the checkpoint again",
        ),
        (
            b'{"format": "hierps-export", "format_version": 2}',
            StoreFormatError,
            "format version 2.*did not bind.*Export the checkpoint again",
        ),
        (b'{"format": "hierps-export", "format_version": 9}', StoreFormatError, "format version 9"),
        (b'{"format": "something"}', StoreFormatError, "not a hierps export manifest"),
        (b"[1, 2]", StoreFormatError, "not a hierps export manifest"),
        (b'{"format": "hierps-export", "format_ver', CorruptStoreError, "cannot be read as JSON"),
    ],
)
def test_foreign_and_other_version_manifests(history, tmp_path, text, error, message):
    root = _copy(history, tmp_path, "full2")
    (root / "full2" / "manifest.json").write_bytes(text)
    with pytest.raises(error, match=re.escape(str(root / "full2" / "manifest.json")) + ".*" + message):
        serving.open(root / "full2")


def test_exports_of_another_version_in_a_serving_directory_are_skipped(history, tmp_path):
    root = _copy(history, tmp_path, "full0", "full1")
    _edit_manifest(root / "full1", lambda m: m.update(format_version=1), fix_crc=True)
    assert [p.name for p in serving.open(root).applied] == ["full0"]
    shutil.rmtree(root / "full0")
    with pytest.raises(StoreFormatError, match="format version 1"):
        serving.open(root)


FOREIGN_META = {
    "pickle codec": lambda m: m.update(codecs=[{"name": "numcodecs.pickle", "configuration": {}}]),
    "object dtype": lambda m: m.update(data_type="object"),
    "zarr v2": None,
}


@pytest.mark.parametrize("kind", list(FOREIGN_META))
def test_a_foreign_zarr_json_is_refused_without_decoding(history, tmp_path, kind):
    root = _copy(history, tmp_path, "full2")
    values = root / "full2" / "t" / "values"
    if FOREIGN_META[kind] is None:
        (values / "zarr.json").rename(values / ".zarray")
        message = "Zarr v2 array"
    else:
        meta = json.loads((values / "zarr.json").read_text())
        FOREIGN_META[kind](meta)
        (values / "zarr.json").write_text(json.dumps(meta))
        message = "not an array hierps wrote"
    with pytest.raises(CorruptStoreError, match=re.escape(str(values)) + ".*" + message):
        serving.open(root / "full2")


# -- memory ---------------------------------------------------------------------------------------------
def test_serving_three_million_rows_holds_only_its_cache_and_index(tmp_path):
    """A 3,000,000-row export (about 200 MB of rows) served in a fresh process by the serving bench's
    ``serve`` phase (random lookups of 1 and 1024 ids, a hot set of half the cache's capacity, then
    as many lookups as a second allows): its peak RSS stays under a bare ``import hierps, torch`` +
    the 64 MiB cache + 150 MiB, and its key index under 2 bytes per key."""
    from hierps.bench import scale
    from hierps.bench import serving as serving_bench

    rows, cache = 3_000_000, 64 << 20
    cfg = serving_bench.ServingConfig(
        sizes=(rows,), cache_bytes=str(cache), samples=50, throughput_seconds=2.0
    )
    conf = scale.phase_config(cfg)
    paths = {"rows": rows, "store": str(tmp_path / "store"), "export": str(tmp_path / "export")}
    for phase in ("write", "export"):
        record = serving_bench.spawn_phase(phase, conf, tmp_path / phase, **paths)
        assert "error" not in record, record["error"]
    record = serving_bench.spawn_phase("serve", conf, tmp_path / "serve", **paths)
    assert "error" not in record, record["error"]
    bound = scale.bare_import_rss() + cache + (150 << 20)
    assert record["index_bytes"] <= 2 * rows
    assert record["peak_rss_bytes"] <= bound, (
        f"serving {rows:,} rows: peak RSS {record['peak_rss_bytes'] >> 20} MiB > {bound >> 20} MiB"
    )


def test_serving_bench_smoke(tmp_path, capsys):
    from hierps.bench import serving as serving_bench
    from hierps.bench.run import add_arguments

    work = tmp_path / "work"
    work.mkdir()
    cfg = serving_bench.ServingConfig(
        sizes=(20_000,), samples=5, throughput_seconds=0.2, disk_bytes=32 << 20, tmp=str(work)
    )
    results = serving_bench.run_serving(cfg)
    [size] = results["sizes"]
    assert list(size["phases"]) == list(serving_bench.PHASES)
    for phase, record in size["phases"].items():
        assert "error" not in record, (phase, record["error"])
        assert record["peak_rss_bytes"] > 0
    serve = size["phases"]["serve"]
    assert serve["cold"]["1"]["p50"] > 0 and serve["warm"]["1024"]["p99"] > 0 and serve["warm_per_s"] > 0
    assert size["phases"]["numpy"]["cold_per_s"] > 0
    assert [g["key"] for g in results["goals"]] == [key for key, _, _ in serving_bench.GOALS]
    assert {g["key"] for g in results["goals"] if g["met"] is None} == set()
    assert "hierps   cold b=1" in capsys.readouterr().out
    assert not any(work.iterdir())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--serving", "--full", "--cache-bytes", "1GiB", "--sizes", "5"])
    parsed = serving_bench.config_from_args(args)
    assert parsed.sizes == (5, 100_000_000) and parsed.cache_bytes == "1GiB"
    with pytest.raises(ValueError, match="cache_bytes"):
        serving_bench.config_from_args(parser.parse_args(["--serving", "--cache-bytes", "lots"]))
