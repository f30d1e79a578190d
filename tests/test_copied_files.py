"""Files copied over one another pass their checksums, but not their binding to what they are.

Each chunk's crc32c is followed by a tag binding it to the store, the array (segment or checkpoint,
and the array's name) and its position. These copies leave every checksum intact and are refused
with ``CorruptStoreError`` naming the file, never served as rows:

- a segment's rows shard copied over another segment's of the same shape and the same keys (so
  the fences, and the manifest's check of them, agree);
- a whole segment directory copied over such a twin;
- two inner chunks swapped within a rows shard;
- an older checkpoint's arrays (keys pending admission) copied over the newest's;
- a segment of another store with the same table and segment id.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hierps
from hierps._store import store_parts
from hierps.errors import CorruptStoreError
from hierps.tiers._reader import CheckpointReader

KEYS = np.arange(300, dtype=np.int64) * 7
NEW = 10_000  # a key seen once per checkpoint: pending admission


def _make(path: Path) -> Path:
    """Checkpoint 1: KEYS at 1.0 (segment 1); checkpoint 2: the same keys at 2.0 (segment 2)."""
    with hierps.Store(path, device="cpu") as store:
        emb = hierps.Embedding(None, 4, store=store, name="t", admission={"min_count": 5})
        for value in (1.0, 2.0):
            store.write("t", KEYS, np.full((len(KEYS), 4), value, np.float32))
            ids = torch.tensor([NEW])
            with store.run_pass({"t": ids}):
                emb(ids).sum().backward()
                store.step()
            store.checkpoint()
        assert store_parts(store).core.ssd.segments("t") == [("t", 1), ("t", 2)]
    return path


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("copies") / "store")


@pytest.fixture
def store_path(template, tmp_path) -> Path:
    shutil.copytree(template, tmp_path / "store")
    return tmp_path / "store"


def _seg(path: Path, seg: int) -> Path:
    return path / "segments" / "t" / f"{seg:08d}"


def _refused(path: Path, file: Path) -> None:
    """Reading the rows, through the store and through a reader, names ``file``."""
    with hierps.Store(path, device="cpu") as store:
        with pytest.raises(CorruptStoreError, match=str(file) + ".*is not the chunk of"):
            store.read_rows("t", KEYS)
    with CheckpointReader(path) as reader:
        with pytest.raises(CorruptStoreError, match="is not the chunk of"):
            reader.read("t", KEYS)


def test_the_template_reads_the_newest_rows(store_path):
    with hierps.Store(store_path, device="cpu") as store:
        np.testing.assert_array_equal(store.read_rows("t", KEYS)[:, :4], 2.0)
        assert (
            store.num_pending("t") == 1
            and store_parts(store).core.pending_keys["t"].count_of(np.array([NEW]))[0] == 2
        )


def test_a_rows_shard_copied_over_a_twin_segment(store_path):
    shard = _seg(store_path, 2) / "rows" / "c" / "0" / "0"
    shutil.copy(_seg(store_path, 1) / "rows" / "c" / "0" / "0", shard)
    _refused(store_path, shard)


def test_a_segment_copied_over_a_twin_segment(store_path):
    shutil.rmtree(_seg(store_path, 2))
    shutil.copytree(_seg(store_path, 1), _seg(store_path, 2))
    _refused(store_path, _seg(store_path, 2))


def test_two_inner_chunks_swapped(store_path):
    shard = _seg(store_path, 2) / "rows" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    page = 4096  # rows chunks start on pages
    data[:page], data[page : 2 * page] = data[page : 2 * page], data[:page]
    shard.write_bytes(bytes(data))
    _refused(store_path, shard)


def test_a_segment_of_another_store(store_path, tmp_path):
    other = _make(tmp_path / "other")  # same table, same segment ids, same keys and rows
    shutil.rmtree(_seg(store_path, 2))
    shutil.copytree(_seg(other, 2), _seg(store_path, 2))
    _refused(store_path, _seg(store_path, 2))


@pytest.mark.parametrize("array", ["pending_keys", "pending_count", "pending_pass"])
def test_an_older_checkpoints_arrays_copied_over_the_newest(store_path, array):
    newest = store_path / "checkpoints" / "00000002" / "t" / array
    shutil.rmtree(newest)
    shutil.copytree(store_path / "checkpoints" / "00000001" / "t" / array, newest)
    with pytest.raises(CorruptStoreError, match=f"{array}.*is not the chunk of"):
        hierps.Store(store_path, device="cpu")
    with (
        CheckpointReader(store_path) as reader,
        pytest.raises(CorruptStoreError, match="is not the chunk of"),
    ):
        reader.pending_keys("t")
