"""A full disk: a clear StoreFullError naming the path and the space needed, the last checkpoint
intact, no row lost, and the next checkpoint succeeding once there is space again.

The real tests put the store on a small tmpfs (2 or 24 MiB; needs the right to mount, skipped
otherwise) and compare every row with the same run on a roomy disk. The simulated ones make the
writes fail with ENOSPC in-process, so they run everywhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hierps
import hierps.storage._files
import hierps.tiers._ssd
from hierps import _faults
from hierps._store import store_parts
from hierps.rows._counters import NUM_COUNTERS
from hierps.tiers._reader import CheckpointReader

DIM = 16  # adagrad: 32 floats, 128 bytes a row
KEYS = np.arange(3000, dtype=np.int64) * 31 - 40_000


def _open(path: Path) -> tuple[hierps.Store, hierps.EmbeddingBag]:
    # Unpipelined: the write-back happens at the end of each pass, where these tests expect it.
    store = hierps.Store(path, memory_budget="8KiB", device="cpu", keep_checkpoints=1, pipeline=False)
    return store, hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")


def _train(store: hierps.Store, bag: hierps.EmbeddingBag, keys: np.ndarray, seed: int) -> None:
    """One pass of 4 mini-batches over ``keys``."""
    rng = np.random.default_rng(seed)
    batches = [torch.from_numpy(rng.permutation(keys)[:64]) for _ in range(4)]
    with store.run_pass([{"t": b} for b in batches]):
        for b in batches:
            (bag(b, torch.arange(0, 64, 8)) ** 2).sum().backward()
            store.step()


def _segments_on_disk(path: Path) -> set[tuple[str, int]]:
    return {(p.parent.name, int(p.name)) for p in (path / "segments").glob("*/*") if p.name.isdigit()}


def _assert_no_leftovers(store: hierps.Store, just_failed: bool = False) -> None:
    """Nothing a failed write left behind: no temp file, no uncommitted checkpoint, no stray segment.

    Right after a real ENOSPC a stray directory may reappear: zarr writes the metadata and chunks
    of an array concurrently and does not wait for the others when one write fails, so one of them
    can recreate what hierps removed. Nothing names it, and the next checkpoint (or open) removes it.
    """
    path = store.path
    assert not list(path.rglob(".*tmp-*"))
    if not just_failed:
        assert {int(p.name) for p in (path / "checkpoints").iterdir() if p.is_dir()} == set(
            store_parts(store).core.catalog.ids()
        )
        assert (
            _segments_on_disk(path)
            <= store_parts(store).core.catalog.referenced_segments()
            | store_parts(store).core.ssd.live_segments()
        )


def _tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"2m"``) mounted under ``tmp_path`` while the fixture lives."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount to make a small file system: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted under tmp_path."""
    yield from _tmpfs(tmp_path, "2m")


@pytest.fixture
def disk(tmp_path):
    """A 24 MiB tmpfs mounted under tmp_path."""
    yield from _tmpfs(tmp_path, "24m")


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with one file; returns it (delete it to free the space)."""
    filler = disk / "filler"
    block = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_real_full_disk_during_write_back_and_checkpoint(small_disk, tmp_path):
    store, bag = _open(small_disk / "store")
    ref, ref_bag = _open(tmp_path / "ref")  # the same work on a big disk
    try:
        for s, b in ((store, bag), (ref, ref_bag)):
            _train(s, b, KEYS[:500], seed=1)
            s.checkpoint("c1")
        c1 = store.read_rows("t", KEYS).copy()
        filler = _fill(small_disk)

        # Write-back at the end of a pass evicts rows to SSD: no space.
        with pytest.raises(hierps.StoreFullError) as info:
            _train(store, bag, KEYS[500:], seed=2)
        _train(ref, ref_bag, KEYS[500:], seed=2)
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert str(small_disk / "store" / "segments" / "t") in str(err)
        assert f"it needs about {err.needed} bytes" in str(err) and (err.needed or 0) > 0
        assert "no space left on the device" in str(err)
        # No row was lost: the store still holds exactly what the big-disk run holds.
        np.testing.assert_array_equal(store.read_rows("t", KEYS), ref.read_rows("t", KEYS))

        # A checkpoint on the full disk fails the same way and leaves no half state.
        with pytest.raises(hierps.StoreFullError):
            store.checkpoint("c2")
        assert store_parts(store).core.catalog.ids() == [1]
        _assert_no_leftovers(store, just_failed=True)
        # The last checkpoint is intact: readable in place, and reopenable from a copy on a bigger disk.
        reader = CheckpointReader(small_disk / "store")
        assert reader.checkpoint_id == 1
        keys = reader.keys("t")
        np.testing.assert_array_equal(
            reader.read("t", keys)[1][:, :-NUM_COUNTERS], c1[np.searchsorted(KEYS, keys)]
        )
        shutil.copytree(small_disk / "store", tmp_path / "copy", ignore=shutil.ignore_patterns("LOCK"))
        with hierps.Store(tmp_path / "copy", device="cpu") as copy:
            copy.table("t", DIM)
            np.testing.assert_array_equal(copy.read_rows("t", KEYS), c1)

        # Space again: the next checkpoint succeeds and holds every row.
        filler.unlink()
        assert store.checkpoint("c2") == 2
        ref.checkpoint("c2")
        _assert_no_leftovers(store)
    finally:
        store.close()
        ref.close()
    with (
        hierps.Store(small_disk / "store", device="cpu") as again,
        hierps.Store(tmp_path / "ref", device="cpu") as r,
    ):
        np.testing.assert_array_equal(again.read_rows("t", KEYS), r.read_rows("t", KEYS))
        assert again.tables["t"].step == r.tables["t"].step


def test_real_full_disk_while_writing_the_checkpoint_arrays(small_disk):
    store, bag = _open(small_disk / "store")
    try:
        _train(store, bag, KEYS[:300], seed=1)
        store.checkpoint("c1")
        filler = _fill(small_disk)
        with pytest.raises(
            hierps.StoreFullError, match=r"checkpoints/00000002: no space left .* arrays of checkpoint 2"
        ):
            store.checkpoint("c2")  # nothing dirty: only the checkpoint's arrays and manifest are written
        assert store_parts(store).core.catalog.ids() == [1]
        _assert_no_leftovers(store, just_failed=True)
        filler.unlink()
        assert store.checkpoint("c2") == 2
        _assert_no_leftovers(store)
    finally:
        store.close()
    with hierps.Store(small_disk / "store", device="cpu") as again:
        assert [c["tag"] for c in again.list_checkpoints()] == ["c2"]


@pytest.fixture
def enospc(monkeypatch):
    """Add ``("segment" | "manifest", store path)``: those writes under that store fail with ENOSPC."""
    armed: set[tuple[str, Path]] = set()

    def full(what: str, path: object) -> bool:
        return any(w == what and Path(str(path)).is_relative_to(p) for w, p in armed)

    real_writer = hierps.storage._segment.ArrayWriter

    def writer(zstore, *args, **kwargs):
        if full("segment", zstore.root):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writer(zstore, *args, **kwargs)

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp-" in str(path) and full("manifest", path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(hierps.storage._segment, "ArrayWriter", writer)
    monkeypatch.setattr(hierps.storage._files, "open", fake_open, raising=False)
    return armed


@pytest.mark.parametrize("pipeline", [False, True])
def test_simulated_full_disk_keeps_every_row(make_store, enospc, pipeline):
    store = make_store("s", memory_budget="8KiB", keep_checkpoints=1, pipeline=pipeline)
    ref = make_store("r", memory_budget="8KiB", keep_checkpoints=1, pipeline=pipeline)
    bags = [hierps.EmbeddingBag(None, DIM, mode="sum", store=s, name="t") for s in (store, ref)]
    for s, b in zip((store, ref), bags):
        _train(s, b, KEYS[:400], seed=1)
        s.checkpoint()
    enospc.add(("segment", store.path))
    with pytest.raises(hierps.StoreFullError, match="no space left on the device while writing segment"):
        _train(store, bags[0], KEYS[400:], seed=2)
        store.flush()  # pipelined, the write-back ran in the background: its error surfaces here
    _train(ref, bags[1], KEYS[400:], seed=2)
    np.testing.assert_array_equal(store.read_rows("t", KEYS), ref.read_rows("t", KEYS))
    with pytest.raises(hierps.StoreFullError):
        store.checkpoint()
    _assert_no_leftovers(store)
    enospc.clear()
    store.checkpoint()
    ref.checkpoint()
    np.testing.assert_array_equal(store.read_rows("t", KEYS), ref.read_rows("t", KEYS))


def test_simulated_full_disk_while_committing_the_manifest(make_store, enospc):
    store = make_store("s", memory_budget="8KiB")
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")
    _train(store, bag, KEYS[:200], seed=1)
    assert store.checkpoint() == 1
    _train(store, bag, KEYS[:200], seed=2)
    rows = store.read_rows("t", KEYS).copy()
    enospc.add(("manifest", store.path))
    with pytest.raises(
        hierps.StoreFullError, match=r"00000002.json: no space left .* the manifest 00000002.json"
    ):
        store.checkpoint()
    assert store_parts(store).core.catalog.ids() == [1]
    _assert_no_leftovers(store)  # the index of checkpoint 2 and the temp manifest are gone
    enospc.clear()
    assert store.checkpoint() == 2
    path = store.path
    store.close()
    with hierps.Store(path, device="cpu") as again:
        np.testing.assert_array_equal(again.read_rows("t", KEYS), rows)


def test_a_deletion_the_disk_refuses_changes_nothing(tmp_path, enospc):
    """A deletion rewrites the segments holding the keys; refused, every row and live count stays."""
    ssd = hierps.tiers._ssd.SsdTier(tmp_path / "segments", store_id="s")
    ssd.add_table("t", 4)
    keys = np.arange(100, dtype=np.int64) * 3
    rows = np.arange(400, dtype=np.float32).reshape(100, 4)
    ssd.write("t", keys, rows)
    ssd.write("t", keys[:50], rows[:50] + 1)  # a newer copy of half of them
    rows[:50] += 1
    enospc.add(("segment", tmp_path))
    with pytest.raises(hierps.StoreFullError):
        ssd.delete("t", keys[::2])
    assert ssd.num_rows("t") == 100
    assert [ssd.segment_live("t", s) for _, s in ssd.segments("t")] == [50, 50]
    found, got = ssd.read("t", keys)
    assert found.all()
    np.testing.assert_array_equal(got, rows)
    enospc.clear()
    assert ssd.delete("t", keys[::2]) == 50
    assert ssd.num_rows("t") == 50
    found, got = ssd.read("t", keys)
    np.testing.assert_array_equal(found, np.arange(100) % 2 == 1)
    np.testing.assert_array_equal(got, rows[1::2])
    ssd.close()


def test_failed_fsync_is_not_retried(make_store, monkeypatch):
    """After a failed fsync the written pages may be gone: no later checkpoint may commit them."""
    store = make_store("s", memory_budget="8KiB")
    bag = hierps.EmbeddingBag(None, DIM, mode="sum", store=store, name="t")
    _train(store, bag, KEYS[:200], seed=1)
    store.checkpoint("c1")
    c1 = store.read_rows("t", KEYS).copy()
    _train(store, bag, KEYS[:200], seed=2)
    real = hierps.tiers._ssd.fsync_tree

    def failing(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hierps.tiers._ssd, "fsync_tree", failing)
    with pytest.raises(hierps.StoreFullError, match="fsync of new segments failed .* open it again"):
        store.checkpoint("c2")
    monkeypatch.setattr(hierps.tiers._ssd, "fsync_tree", real)
    with pytest.raises(hierps.StoreFullError, match="fsync of new segments failed"):
        store.checkpoint("c2")
    assert store_parts(store).core.catalog.ids() == [1]
    path = store.path
    store.close()
    with hierps.Store(path, device="cpu") as again:
        assert again.list_checkpoints()[-1]["tag"] == "c1"
        np.testing.assert_array_equal(again.read_rows("t", KEYS), c1)


# -- a full disk on a larger store: 6,000 rows, a 32 KiB RAM tier ------------------------------------
MANY = np.arange(6000, dtype=np.int64) * 13 - 7000
ADAM = {"type": "adam", "params": {"lr": 0.01}}


def _open_many(path: Path, **settings: Any) -> tuple[hierps.Store, hierps.EmbeddingBag]:
    """A store whose RAM tier holds 232 of the 6,000 Adam rows (dim 8): every pass evicts to SSD."""
    store = hierps.Store(path, memory_budget="32KiB", device="cpu", keep_checkpoints=1, **settings)
    return store, hierps.EmbeddingBag(None, 8, mode="sum", store=store, name="t", optimizer=ADAM)


def _many_batches(seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [{"t": torch.from_numpy(rng.permutation(MANY)[:1500])} for _ in range(4)]


def _train_many(
    store: hierps.Store,
    bag: hierps.EmbeddingBag,
    seed: int,
    before_end: Callable[[], object] | None = None,
) -> None:
    """One pass of 4 mini-batches of 1,500 ids, announcing the next pass (``seed + 1``);
    ``before_end`` runs after its last step."""
    batches = _many_batches(seed)
    store.begin_pass(batches)
    store.prefetch(_many_batches(seed + 1))
    for b in batches:
        (bag(b["t"], torch.arange(0, 1500, 10)) ** 2).sum().backward()
        store.step()
    if before_end is not None:
        before_end()
    store.end_pass()


def _rows_and_state(store: hierps.Store) -> tuple[np.ndarray, int, int]:
    """Every row of MANY (weights and optimizer state), the table's step and the pass counter."""
    return store.read_rows("t", MANY).copy(), store.tables["t"].step, store_parts(store).core.passes


def _assert_same(seen: tuple[np.ndarray, int, int], store: hierps.Store) -> None:
    """``store`` holds the rows, step and pass counter ``seen`` (of :func:`_rows_and_state`)."""
    rows, step, passes = _rows_and_state(store)
    np.testing.assert_array_equal(rows, seen[0])
    assert (step, passes) == seen[1:]


class _FillDuring(list[str]):
    """Handed to ``hierps._faults.trace``: fills ``disk`` the first time the pipeline's worker
    reaches fault point ``point`` once armed."""

    def __init__(self, disk: Path, point: str) -> None:
        super().__init__()
        self.disk, self.point = disk, point
        self.armed = False
        self.filler: Path | None = None

    def append(self, name: str) -> None:
        if (
            self.armed
            and self.filler is None
            and name == self.point
            and threading.current_thread().name.startswith("hierps-pass")
        ):
            self.filler = _fill(self.disk)


def test_real_full_disk_during_a_background_compaction_then_retried_checkpoints(disk, tmp_path):
    """The disk fills while the pipeline's worker merges segments; once space is freed, the first
    checkpoint returns, and the store reopens at it with exactly the rows it served then, which
    are those of the same passes on a roomy disk."""
    store, bag = _open_many(disk / "store", max_segments=3)
    fill = _FillDuring(disk, "ssd.compaction_begin")
    done = 0  # passes ended before the error reached the training loop
    with store:
        _faults.trace(fill)
        try:
            with pytest.raises(hierps.StoreFullError, match="no space left on the device while writing"):
                for i in range(8):
                    fill.armed = i >= 2
                    _train_many(store, bag, seed=i)
                    done += 1
                store.checkpoint()
        finally:
            _faults.trace(None)
        assert fill.filler is not None and done >= 2
        fill.filler.unlink()
        errors: list[Exception] = []
        for _ in range(3):  # retried until it returns: it must return the first time
            try:
                store.checkpoint()
                break
            except Exception as exc:
                errors.append(exc)
        assert errors == []
        served = _rows_and_state(store)
    ref, ref_bag = _open_many(tmp_path / "ref", max_segments=3)
    with ref:
        for i in range(done):
            _train_many(ref, ref_bag, seed=i)
        ref.checkpoint()
        _assert_same(served, ref)
    with _open_many(disk / "store", max_segments=3)[0] as again:
        _assert_same(served, again)


def test_real_full_disk_at_end_pass_keeps_the_pass_in_ram(disk, tmp_path):
    """Unpipelined, the write-back at end_pass grows the RAM tier over its budget with the rows the
    disk refused: StoreFullError, and every row of the pass kept, as on a roomy disk."""
    store, bag = _open_many(disk / "store", pipeline=False)
    ref, ref_bag = _open_many(tmp_path / "ref", pipeline=False)
    with store, ref:
        for s, b in ((store, bag), (ref, ref_bag)):
            _train_many(s, b, seed=1)
            s.checkpoint()
        fillers: list[Path] = []
        with pytest.raises(hierps.StoreFullError, match="no space left on the device while writing segment"):
            _train_many(store, bag, seed=2, before_end=lambda: fillers.append(_fill(disk)))
        _train_many(ref, ref_bag, seed=2)
        assert store_parts(store).core.memory.bytes_used > 32 << 10  # the rows the disk refused
        _assert_same(_rows_and_state(store), ref)  # the pass ended, with every row
        fillers[0].unlink()
        assert store.checkpoint() == 2
        ref.checkpoint()
        _train_many(store, bag, seed=3)
        _train_many(ref, ref_bag, seed=3)
        _assert_same(_rows_and_state(store), ref)
        store.checkpoint()
        ref.checkpoint()
    with _open_many(disk / "store")[0] as again, _open_many(tmp_path / "ref")[0] as ref:
        _assert_same(_rows_and_state(again), ref)


def _open_under(path: Path) -> list[str]:
    """What this process's open descriptors under ``path`` name (``... (deleted)`` for a removed file)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the descriptor listdir used)
        if target.startswith(f"{path}/"):
            out.append(target)
    return out


def _used_bytes(path: Path) -> int:
    """Bytes the file system of ``path`` has in use."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _free_bytes(path: Path) -> int:
    """Bytes free on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _file_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take (their allocated blocks)."""
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def test_failed_segment_writes_close_their_files(disk):
    """A segment write the disk refuses leaves no descriptor open: the space of the removed partial
    file is free again, and once the store is closed nothing holds the file system."""
    store, bag = _open_many(disk / "store", pipeline=False)
    with store:
        _train_many(store, bag, seed=1)
        store.checkpoint()
        filler = _fill(disk)
        for seed in (2, 3):  # two failed write-backs, then a failed checkpoint
            with pytest.raises(hierps.StoreFullError):
                _train_many(store, bag, seed=seed)
        with pytest.raises(hierps.StoreFullError):
            store.checkpoint()
        assert not [f for f in _open_under(disk) if f.endswith(" (deleted)")]
        assert _used_bytes(disk) == _file_bytes(disk)
        filler.unlink()
        store.checkpoint()
        assert _used_bytes(disk) == _file_bytes(disk)
    assert _open_under(disk) == []  # nothing keeps the file system from being unmounted


def test_an_export_the_disk_refuses_closes_its_files(disk, tmp_path):
    """An export that fills the disk raises StoreFullError, leaves nothing behind and keeps no
    descriptor of its removed files open; with space freed, the same export succeeds."""
    store, bag = _open_many(tmp_path / "store", pipeline=False)
    with store:
        _train_many(store, bag, seed=1)
        store.checkpoint()
        big = disk / "big"
        big.write_bytes(b"\0" * (_free_bytes(disk) - (64 << 10)))  # room for a fraction of the export
        with pytest.raises(hierps.StoreFullError):
            store.export(disk / "export")
        assert _open_under(disk) == []
        assert sorted(p.name for p in disk.iterdir()) == ["big"]
        assert _used_bytes(disk) == _file_bytes(disk)
        big.unlink()
        store.export(disk / "export")
        served = hierps.serving.open(disk / "export")
        keys = MANY[::7]
        for table in store.tables:
            np.testing.assert_array_equal(served.lookup(table, keys), store.lookup(table, keys).numpy())
        served.close()
    assert _open_under(disk) == []


def test_a_shrink_the_disk_refuses_changes_no_row(disk):
    """Shrink rewrites the segments holding condemned rows; refused by a full disk, every row
    (the newest copy, in RAM or on SSD) reads as before, and the retried shrink deletes them."""
    store, bag = _open_many(disk / "store", pipeline=False)
    with store:
        _train_many(store, bag, seed=1)
        store.checkpoint()
        _train_many(store, bag, seed=2)  # newer rows, some only in RAM
        tables = sorted(store.tables)
        before = {t: store.read_rows(t, MANY) for t in tables}
        filler = _fill(disk)
        with pytest.raises(hierps.StoreFullError):
            store.shrink(min_decayed_count=1.5)
        for t in tables:
            np.testing.assert_array_equal(store.read_rows(t, MANY), before[t])
        filler.unlink()
        deleted = store.shrink(min_decayed_count=1.5)
        assert sum(deleted.values()) > 0
