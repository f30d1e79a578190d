"""Damaged files are detected on read, with an error naming the file, never returned as rows.

Every chunk (segment keys and rows, checkpoint index) carries a crc32c; manifests carry a CRC-32.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
import zarr.codecs
from zarr.storage import LocalStore

import hierps
from hierps._store import store_parts
from hierps.errors import CorruptStoreError
from hierps.tiers._reader import CheckpointReader

KEYS = np.arange(200, dtype=np.int64) * 13


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A store with checkpoints 1 and 2 whose rows live in several SSD segments; rows of both."""
    path = tmp_path_factory.mktemp("template") / "store"
    rows = []
    with hierps.Store(path, memory_budget="1KiB", device="cpu") as store:
        bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
        for i in range(4):
            with store.run_pass({"t": KEYS}):
                bag(torch.from_numpy(KEYS[i::2]), torch.arange(0, 100, 10)).sum().backward()
                store.step()
            if i % 2:
                store.checkpoint()
                rows.append(store.read_rows("t", KEYS).copy())
    return path, rows[1], rows[0]


@pytest.fixture
def stored(template, tmp_path) -> tuple[Path, np.ndarray]:
    """A copy of the template store, and the rows of its latest checkpoint."""
    path, rows, _ = template
    shutil.copytree(path, tmp_path / "store")
    return tmp_path / "store", rows


def _segments(path: Path) -> list[Path]:
    """Segment directories the latest checkpoint uses."""
    with hierps.Store(path, device="cpu") as store:
        segs = [s for _, s in store_parts(store).core.ssd.segments("t")]
    return [path / "segments" / "t" / f"{s:08d}" for s in segs]


def _flip(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x40
    path.write_bytes(bytes(data))


def _first_chunk(array_dir: Path) -> Path:
    return sorted(p for p in (array_dir / "c").rglob("*") if p.is_file())[0]


def test_zarr_crc32c_codec_raises_on_a_flipped_byte(tmp_path):
    """What hierps relies on in zarr 3.1: a crc32c mismatch raises (ValueError), it is not ignored."""
    arr = zarr.create_array(
        LocalStore(tmp_path),
        name="a",
        shape=(8,),
        chunks=(8,),
        dtype="float32",
        compressors=[zarr.codecs.Crc32cCodec()],
        fill_value=0.0,
    )
    arr[:] = np.arange(8, dtype=np.float32)
    _flip(tmp_path / "a" / "c" / "0", 2)
    with pytest.raises(ValueError, match="checksum"):
        zarr.open_array(LocalStore(tmp_path), path="a", mode="r")[:]


@pytest.mark.parametrize("part", ["rows", "fences", "filter"])
def test_flipped_byte_in_a_segment_chunk(stored, part):
    path, _ = stored
    chunk = _first_chunk(_segments(path)[0] / part)
    _flip(chunk)
    with hierps.Store(path, device="cpu") as store:
        with pytest.raises(CorruptStoreError, match=re.escape(str(chunk)) + ".*crc32c"):
            store.read_rows("t", KEYS)
    reader = CheckpointReader(path)
    with pytest.raises(CorruptStoreError, match=re.escape(str(chunk))):
        reader.read("t", reader.keys("t"))


def test_truncated_and_missing_segment_chunks(stored):
    path, _ = stored
    first, second = _segments(path)[:2]
    chunk = _first_chunk(first / "rows")
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with (
        hierps.Store(path, device="cpu") as store,
        pytest.raises(CorruptStoreError, match=re.escape(str(chunk))),
    ):
        store.read_rows("t", KEYS)
    # A missing chunk would read as zeros in zarr: hierps reports it instead.
    chunk.unlink()
    with hierps.Store(path, device="cpu") as store, pytest.raises(CorruptStoreError, match="chunk missing"):
        store.read_rows("t", KEYS)


def test_segment_swapped_for_another_is_caught_by_its_keys(stored):
    """Intact checksums, wrong content: the segment's keys do not match what the manifest names."""
    path, _ = stored
    first, second = _segments(path)[:2]
    shutil.rmtree(first)
    shutil.copytree(second, first)
    with hierps.Store(path, device="cpu") as store:
        with pytest.raises(
            CorruptStoreError,
            match=re.escape(str(first)) + r"(: holds key|.*do not form|.*is not the chunk of)",
        ):
            store.read_rows("t", KEYS)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "not json"])
def test_damaged_manifest(stored, damage):
    path, rows = stored
    manifest = path / "checkpoints" / "00000002.json"
    text = manifest.read_bytes()
    if damage == "truncate":
        manifest.write_bytes(text[: len(text) // 2])
    elif damage == "flip":
        manifest.write_bytes(text.replace(b'"dim": 4', b'"dim": 5'))
    elif damage == "empty":
        manifest.write_bytes(b"")
    else:
        manifest.write_bytes(b"\x00\xff garbage")
    expected = "checksum mismatch" if damage == "flip" else "cannot be read as a hierps manifest"
    with pytest.raises(CorruptStoreError, match=re.escape(str(manifest)) + ": " + expected):
        hierps.Store(path, device="cpu")
    with pytest.raises(CorruptStoreError, match=re.escape(str(manifest))):
        CheckpointReader(path)
    # Putting the file back makes the store whole again.
    manifest.write_bytes(text)
    with hierps.Store(path, device="cpu") as store:
        np.testing.assert_array_equal(store.read_rows("t", KEYS), rows)


def test_moving_a_damaged_manifest_aside_falls_back_to_the_checkpoint_before(template, tmp_path):
    path, _, first_rows = template
    shutil.copytree(path, tmp_path / "store")
    manifest = tmp_path / "store" / "checkpoints" / "00000002.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    with pytest.raises(CorruptStoreError, match="moving it out of the store directory falls back"):
        hierps.Store(tmp_path / "store", device="cpu")
    manifest.rename(tmp_path / "damaged.json")
    with hierps.Store(tmp_path / "store", device="cpu") as store:
        assert store.checkpoint_id == 1
        np.testing.assert_array_equal(store.read_rows("t", KEYS), first_rows)


def test_damaged_store_marker(stored):
    path, _ = stored
    (path / "hierps.json").write_text('{"crc32": 1, "body": {"format": "hierps-store"}}')
    with pytest.raises(CorruptStoreError, match="hierps.json: checksum mismatch"):
        hierps.Store(path, device="cpu")
    with pytest.raises(CorruptStoreError, match="hierps.json: checksum mismatch"):
        CheckpointReader(path)
