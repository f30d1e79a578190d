"""Retired segments are renamed out of their table's directory at once and deleted in the background
(:class:`hierps.storage._files.Remover`), or written into again: the live set, the rows and what is on
disk stay as they were. New segments find their directories made ahead, or a retired segment's
(:class:`hierps.storage._files.Skeletons`)."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

import numpy as np

from hierps.storage._files import OpenFiles, Remover, Skeletons
from hierps.storage._segment import SEGMENT_DIRS
from hierps.tiers._ssd import SsdTier

T = "t"
WIDTH = 5


def _dirs(root: Path, table: str) -> set[int]:
    tdir = root / table
    return {int(p.name) for p in tdir.iterdir() if p.is_dir()} if tdir.exists() else set()


def _tree(root: Path, files: int) -> None:
    (root / "a" / "b").mkdir(parents=True)
    for i in range(files):
        (root / "a" / "b" / f"f{i}").write_bytes(b"x" * 100)


def test_remover_renames_at_once_and_deletes_in_the_background(tmp_path):
    trash = tmp_path / ".removed"
    remover = Remover(trash)
    for i in range(5):
        _tree(tmp_path / f"d{i}", 3)
        remover.remove(tmp_path / f"d{i}")
        assert not (tmp_path / f"d{i}").exists()  # gone from its place before the call returns
    remover.remove(tmp_path / "never-made")  # nothing to delete: no error
    remover.wait()
    assert list(trash.iterdir()) == []
    _tree(trash / "left-by-a-killed-process", 2)
    remover.empty()
    assert list(trash.iterdir()) == []
    remover.close()
    _tree(tmp_path / "after-close", 1)
    remover.remove(tmp_path / "after-close")  # a closed remover starts another thread
    remover.close()
    assert not (tmp_path / "after-close").exists() and list(trash.iterdir()) == []


def test_large_retired_segments_are_deleted_not_written_into_again(tmp_path, monkeypatch):
    monkeypatch.setattr("hierps.tiers._ssd._RECYCLE_BYTES", 400 * 4 * (WIDTH + 2) - 1)  # under a segment
    tier = SsdTier(tmp_path, max_segments=2, store_id="test")
    tier.add_table(T, WIDTH)
    tier.collect_garbage(set())
    rng = np.random.default_rng(1)
    for _ in range(6):
        keys = rng.choice(3000, 400, replace=False).astype(np.int64)
        tier.write(T, keys, rng.standard_normal((len(keys), WIDTH)).astype(np.float32))
        tier.compact(T)
    tier.wait_removals()
    assert tier._skeletons.reused == 0 and tier._skeletons._recycled == deque()
    assert list((tmp_path / ".removed").iterdir()) == []  # deleted, in the background
    tier.close()


def test_forget_under_closes_only_the_files_below(tmp_path):
    files = OpenFiles()
    paths = [
        tmp_path / "t" / "00000001" / "x",
        tmp_path / "t" / "00000011" / "x",
        tmp_path / "t" / "00000001x",
    ]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"1")
        files.release(files.acquire(p))
    files.forget_under(tmp_path / "t" / "00000001")
    assert len(files) == 2  # 00000011/x and 00000001x stay open
    files.forget_under(tmp_path / "t")
    assert len(files) == 0


def test_compaction_leaves_only_the_live_set_and_exact_rows_after_a_reopen(tmp_path):
    rng = np.random.default_rng(0)
    tier = SsdTier(tmp_path, max_segments=2, store_id="test")
    tier.add_table(T, WIDTH)
    tier.collect_garbage(set())  # nothing protected: every retired segment is deleted
    oracle: dict[int, np.ndarray] = {}
    for _ in range(15):
        keys = rng.choice(3000, 400, replace=False).astype(np.int64)
        rows = rng.standard_normal((len(keys), WIDTH)).astype(np.float32)
        tier.write(T, keys, rows)
        oracle.update(zip(keys.tolist(), rows))
        tier.compact(T)
        # No retired segment is left in the table's directory, whether or not its files are deleted yet.
        assert _dirs(tmp_path, T) == {s for _, s in tier.segments(T)}
    keys = np.array(sorted(oracle), np.int64)
    want = np.stack([oracle[k] for k in keys.tolist()])
    found, rows = tier.read(T, keys)
    assert found.all() and np.array_equal(rows.view(np.uint32), want.view(np.uint32))
    # Retired trees were written into again (the rows above read back exactly from them).
    assert tier._skeletons.reused > 0
    recorded = tier.live_set(T)
    tier.close()
    removed = tmp_path / ".removed"  # deleted by the time the tier is closed, or never moved there
    assert not removed.exists() or list(removed.iterdir()) == []
    assert list((tmp_path / ".spare").iterdir()) == []  # the trees held for reuse, deleted at close

    fresh = SsdTier(tmp_path, max_segments=2, store_id="test")
    fresh.add_table(T, WIDTH)
    fresh.load_segments(T, WIDTH, recorded)
    fresh.next_segment = fresh.max_segment_on_disk() + 1  # what a store does on opening
    fresh.collect_garbage(set())
    found, rows = fresh.read(T, keys)
    assert found.all() and np.array_equal(rows.view(np.uint32), want.view(np.uint32))
    assert fresh.num_rows(T) == len(keys)
    fresh.close()


def test_skeletons_are_made_ahead_and_renamed_into_place(tmp_path):
    spare = tmp_path / ".spare"
    trees = Skeletons(spare, ("x/c/0", "y/c"), keep=4)
    for i in range(1, 8):  # the table's directory made with the first; refills as they are taken
        assert trees.place(tmp_path / "t" / str(i))
        assert (tmp_path / "t" / str(i) / "x" / "c" / "0").is_dir() and (
            tmp_path / "t" / str(i) / "y" / "c"
        ).is_dir()
    trees.wait()
    ahead = trees._asked - trees._taken
    assert trees.placed == 7 and 2 <= ahead <= 4 and len(list(spare.iterdir())) == ahead
    (spare / "left-by-a-killed-process" / "x").mkdir(parents=True)
    trees.empty()
    assert sorted(p.name.rsplit("-", 1)[0] for p in spare.iterdir()) == [trees._prefix] * ahead
    assert not trees.place(tmp_path / "t" / "2")  # taken: not placed over it, and that tree deleted
    assert len(list(spare.iterdir())) == ahead - 1
    trees.close()
    assert list(spare.iterdir()) == []
    assert trees.place(tmp_path / "t" / "8")  # a closed one starts again


def test_trees_given_back_are_placed_first_in_their_order_with_their_files_cut(tmp_path):
    spare = tmp_path / ".spare"
    trees = Skeletons(spare, ("x/c/0", "y/c"), keep=4, hold=2)
    for i in range(3):
        tree = tmp_path / "t" / f"old{i}"
        (tree / "x" / "c" / "0").mkdir(parents=True)
        (tree / "y" / "c").mkdir(parents=True)
        (tree / "x" / "c" / "0" / "0").write_bytes(b"rows of old %d" % i)
        (tree / "y" / "zarr.json").write_bytes(b"{}")
        # hold=2: the third is not taken, and stays where it was for the caller to delete
        assert trees.recycle(tree) == (i < 2) and tree.exists() == (i == 2)
    trees.wait()
    inodes = [(spare / f"{trees._prefix}-r{i}" / "x" / "c" / "0" / "0").stat().st_ino for i in range(2)]
    for i in range(2):
        new = tmp_path / "t" / f"new{i}"
        assert trees.place(new)
        assert (new / "x" / "c" / "0" / "0").stat().st_ino == inodes[i]  # the oldest first, files and all
        # Cut to their first byte (never to 0 bytes: see Skeletons), for their writers to write over.
        assert (new / "x" / "c" / "0" / "0").read_bytes() == b"r" and (
            new / "y" / "zarr.json"
        ).read_bytes() == b"{"
    assert trees.placed == 2 and trees.reused == 2 and trees._asked == 0  # nothing made ahead yet
    assert trees.place(tmp_path / "t" / "new2") and trees.reused == 2  # none held: one made ahead
    assert (tmp_path / "t" / "new2" / "y" / "c").is_dir() and list((tmp_path / "t" / "new2").rglob("0")) != []
    assert trees.recycle(tmp_path / "t" / "new0")
    trees.close()  # the tree held is deleted with those made ahead
    assert list(spare.iterdir()) == []


def test_a_file_with_a_hard_link_elsewhere_keeps_its_bytes_there(tmp_path):
    """A backup made of hard links (``cp -al``) of a segment that is later retired keeps its bytes:
    that file is unlinked from the tree given back, not cut; the others are cut."""
    trees = Skeletons(tmp_path / ".spare", ("x/c",), keep=2)
    tree = tmp_path / "t" / "old"
    (tree / "x" / "c").mkdir(parents=True)
    (tree / "x" / "c" / "0").write_bytes(b"rows")
    (tree / "x" / "zarr.json").write_bytes(b"{}")
    (tmp_path / "backup").mkdir()
    os.link(tree / "x" / "c" / "0", tmp_path / "backup" / "0")
    assert trees.recycle(tree)
    assert trees.place(tmp_path / "t" / "new")
    assert (tmp_path / "backup" / "0").read_bytes() == b"rows"
    assert not (tmp_path / "t" / "new" / "x" / "c" / "0").exists()  # its writer makes it again
    assert (tmp_path / "t" / "new" / "x" / "zarr.json").read_bytes() == b"{"
    trees.close()


def test_skeletons_that_cannot_be_made_leave_the_directories_to_the_writer(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    trees = Skeletons(tmp_path / "a-file" / ".spare", ("x",), keep=4)
    assert not trees.place(tmp_path / "t" / "1") and not (tmp_path / "t" / "1").exists()
    trees.close()


def test_segments_written_into_directories_made_ahead_read_back_exactly(tmp_path, monkeypatch):
    from hierps.storage import _arrays

    tier = SsdTier(tmp_path / "ssd", store_id="s")
    tier.add_table(T, WIDTH)
    tier.write(T, np.arange(3, dtype=np.int64), np.zeros((3, WIDTH), np.float32))  # the table's directory
    made: list[Path] = []
    real = _arrays.make_dir
    monkeypatch.setattr(_arrays, "make_dir", lambda path: (made.append(path), real(path)))
    rng = np.random.default_rng(0)
    written = {k: np.zeros(WIDTH, np.float32) for k in range(3)}
    for i in range(6):
        keys = np.arange(i * 50, i * 50 + 80, dtype=np.int64)  # overlapping: newer rows supersede
        rows = rng.standard_normal((len(keys), WIDTH)).astype(np.float32)
        tier.write(T, keys, rows)
        written.update(zip(keys.tolist(), rows))
    assert tier._skeletons.placed >= 6  # every segment written (merges too) into a tree made ahead
    assert made == []  # its writers made no directory (nor tried: each would fail)
    keys = np.array(sorted(written), dtype=np.int64)
    found, rows = tier.read_many({T: keys})[T]
    assert found.all()
    np.testing.assert_array_equal(rows, np.stack([written[k] for k in keys.tolist()]))
    for seg in _dirs(tier.root, T):
        for rel in SEGMENT_DIRS:
            assert (tier.root / T / f"{seg:08d}" / rel).is_dir()
    tier.close()
    assert not (tier.root / ".spare").exists() or list((tier.root / ".spare").iterdir()) == []


def test_a_written_segment_reads_through_the_array_its_writer_describes(tmp_path):
    """A write-back's segment is read through the rows' array as its writer describes it (nothing
    read back to open it): what opening it from disk gives, chunk for chunk."""
    tier = SsdTier(tmp_path, store_id="test")
    tier.add_table(T, WIDTH)
    rng = np.random.default_rng(3)
    for n in (1, 40, 1_000):  # one chunk, a partial last chunk, many
        keys = np.sort(rng.choice(10**6, n, replace=False)).astype(np.int64)
        rows = rng.standard_normal((n, WIDTH)).astype(np.float32)
        tier.write(T, keys, rows)
        seg = tier._segs[T][max(tier._segs[T])]
        described = seg._rows
        assert described is not None  # preloaded by the write
        seg._rows = None
        opened = seg.rows_array  # opened from disk
        for field in ("path", "shape", "dtype", "chunk_rows", "chunks_per_file", "files", "seed", "identity"):
            assert getattr(described, field) == getattr(opened, field), field
        chunks = np.arange(opened.n_chunks, dtype=np.int64)
        assert np.array_equal(described.chunk_offsets(chunks), opened.chunk_offsets(chunks))
        seg._rows = described
        found, got = tier.read(T, keys)
        assert found.all() and np.array_equal(got.view(np.uint32), rows.view(np.uint32))
    tier.close()


def test_a_tree_placed_without_an_arrays_folder_still_takes_the_segment(tmp_path, monkeypatch):
    """A segment writer told its directories are there makes the one that is missing (a tree given
    back by a writer that wrote no rows has no rows/c/0), and the segment reads back exactly."""
    tier = SsdTier(tmp_path / "ssd", store_id="s")
    tier.add_table(T, WIDTH)
    first = np.arange(3, dtype=np.int64)
    tier.write(T, first, np.zeros((3, WIDTH), np.float32))

    def place(path: Path) -> bool:  # a tree with the filter's and fences' folders, no rows/
        for rel in ("fences/c", "filter/c"):
            (path / rel).mkdir(parents=True)
        return True

    monkeypatch.setattr(tier._skeletons, "place", place)
    keys = np.arange(10, 3010, 3, dtype=np.int64)
    rows = np.random.default_rng(1).standard_normal((len(keys), WIDTH)).astype(np.float32)
    tier.write(T, keys, rows)
    found, got = tier.read(T, keys)
    assert found.all() and np.array_equal(got.view(np.uint32), rows.view(np.uint32))
    tier.close()


def test_a_small_segment_written_over_a_larger_ones_tree_keeps_no_byte_of_it(tmp_path):
    """A retired segment's files are cut to their first byte and written over by the next segment,
    not truncated to 0 bytes: a segment far smaller than the one before it in the tree ends each
    file at its own length (nothing of the old segment left past it), and reads back exactly, from
    its writer's description and after a reopen."""
    tier = SsdTier(tmp_path, store_id="test")
    tier.add_table(T, WIDTH)
    tier.collect_garbage(set())  # nothing protected: a retired tree is given back
    rng = np.random.default_rng(5)
    big = np.arange(0, 40_000, 2, dtype=np.int64)
    tier.write(T, big, rng.standard_normal((len(big), WIDTH)).astype(np.float32))
    (old,) = [s for _, s in tier.segments(T)]
    old_tree = tmp_path / T / f"{old:08d}"
    old_sizes = {p.relative_to(old_tree): p.stat().st_size for p in old_tree.rglob("*") if p.is_file()}
    tier.delete(T, big)  # rewrites the segment without them: the old tree is given back
    tier.wait_removals()
    assert tier._skeletons._recycled
    keys = np.array([3, 7, 11], np.int64)
    rows = rng.standard_normal((len(keys), WIDTH)).astype(np.float32)
    tier.write(T, keys, rows)
    assert tier._skeletons.reused >= 1
    (seg,) = [s for _, s in tier.segments(T)]
    tree = tmp_path / T / f"{seg:08d}"
    sizes = {p.relative_to(tree): p.stat().st_size for p in tree.rglob("*") if p.is_file()}
    shard = Path("rows/c/0/0")
    assert sizes[shard] < old_sizes[shard] // 10  # its own length, not the old one's
    meta = json.loads((tree / "rows" / "zarr.json").read_text())  # whole JSON: no old tail after it
    assert meta["shape"] == [len(keys), WIDTH + 2]
    found, got = tier.read(T, keys)
    assert found.all() and np.array_equal(got.view(np.uint32), rows.view(np.uint32))
    recorded = tier.live_set(T)
    tier.close()
    fresh = SsdTier(tmp_path, store_id="test")
    fresh.add_table(T, WIDTH)
    fresh.load_segments(T, WIDTH, recorded)
    found, got = fresh.read(T, keys)
    assert found.all() and np.array_equal(got.view(np.uint32), rows.view(np.uint32))
    assert not fresh.contains(T, big).any()
    fresh.close()
