"""A checkpoint's manifest as one typed record: what the store writes is what ``Manifest`` reads,
field for field, and ``Store.usage()`` counts what the tiers hold."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hierps
from hierps.errors import ConfigError, CorruptStoreError
from hierps.storage import Manifest, SegmentRef, TableEntry


def _store_with_rows(path, n=300, **kwargs):
    store = hierps.Store(path, **kwargs)
    store.table("t", 4, optimizer={"type": "adagrad", "params": {"lr": 0.1}})
    store.table("u", 2, weights_dtype="bf16")
    store.write("t", np.arange(n), np.ones((n, 4), np.float32))
    store.write("u", np.arange(7) * 3, np.zeros((7, 2), np.float32))
    return store


def test_the_manifest_file_reads_back_field_for_field(tmp_path):
    with _store_with_rows(tmp_path / "s") as store:
        ckpt = store.checkpoint("first", extra={"run": "a", "world_size": 1})
    body = json.loads((tmp_path / "s" / "checkpoints" / f"{ckpt:08d}.json").read_text())["body"]
    manifest = Manifest.from_json(tmp_path / "m.json", ckpt, body)
    assert manifest.to_json() == body
    assert (manifest.id, manifest.tag, manifest.extra, manifest.world_size) == (
        ckpt,
        "first",
        {"run": "a", "world_size": 1},
        1,
    )
    t = manifest.tables["t"]
    assert t.rows == 300 and t.pending == 0 and sum(ref.live for ref in t.segments.values()) == 300
    assert all(isinstance(ref, SegmentRef) for ref in t.segments.values())
    info = t.table_info("t", manifest.seed)
    assert (info.dim, info.optimizer.type, info.optimizer.params["lr"]) == (4, "adagrad", 0.1)
    assert manifest.tables["u"].table_info("u", manifest.seed).weights_dtype == "bf16"
    # The reader's typed view and its JSON view are the same manifest.
    reader = hierps.CheckpointReader(tmp_path / "s")
    assert reader.meta == manifest and reader.manifest == body
    assert reader.tables["t"] == t.to_json() and reader.entry("t") == t


def test_an_entry_of_a_table_whose_counts_disagree_names_the_field(tmp_path):
    with _store_with_rows(tmp_path / "s") as store:
        ckpt = store.checkpoint()
    body = json.loads((tmp_path / "s" / "checkpoints" / f"{ckpt:08d}.json").read_text())["body"]
    body["tables"]["t"]["rows"] += 1
    with pytest.raises(
        CorruptStoreError, match=r"field tables\.t\.rows: expected the sum of its segments' live rows \(300\)"
    ):
        Manifest.from_json(tmp_path / "m.json", ckpt, body)
    body["tables"]["t"]["rows"] -= 1
    with pytest.raises(CorruptStoreError, match="field id: expected the checkpoint id 9"):
        Manifest.from_json(tmp_path / "m.json", 9, body)


def test_an_adopted_segments_origin_reads_back_and_a_bad_one_names_the_field(tmp_path):
    """A segment adopted from another store records what its chunks are bound to; only for such
    segments, and only in that form."""
    with _store_with_rows(tmp_path / "s") as store:
        ckpt = store.checkpoint()
    body = json.loads((tmp_path / "s" / "checkpoints" / f"{ckpt:08d}.json").read_text())["body"]
    assert "origin" not in body["tables"]["t"]  # none adopted: the field is left out
    seg = next(iter(body["tables"]["t"]["segments"]))
    body["tables"]["t"]["origin"] = {seg: "0f3a:segments/t:x/00000012"}
    manifest = Manifest.from_json(tmp_path / "m.json", ckpt, body)
    assert manifest.tables["t"].segments[int(seg)].origin == "0f3a:segments/t:x/00000012"
    assert manifest.to_json() == body
    for bad in ({"999": "0f3a:segments/t/00000012"}, {seg: "segments/t/00000012"}, {seg: 7}, []):
        body["tables"]["t"]["origin"] = bad
        with pytest.raises(
            CorruptStoreError, match=r"field tables\.t\.origin: expected an object of segment id"
        ):
            Manifest.from_json(tmp_path / "m.json", ckpt, body)


def test_a_manifest_a_reader_would_refuse_is_not_written(tmp_path):
    entry = TableEntry({"dim": 4}, rows=1, pending=0, segments={1: SegmentRef(2, 1, 0)})
    bad = Manifest(
        1, tag=None, created=0.0, seed=0, passes=0, next_segment=1, keep_checkpoints=3, tables={"t": entry}
    )
    with pytest.raises(
        ConfigError, match=r"checkpoint 1 would not be readable, so it was not written: .*tables\.t\.width"
    ):
        bad.check(tmp_path / "00000001.json")
    with _store_with_rows(tmp_path / "s") as store:
        with pytest.raises(ConfigError, match="checkpoint extra: expected a JSON object"):
            store.checkpoint(extra={"x": float("nan")})
        assert store.list_checkpoints() == []


def test_usage_counts_the_rows_of_each_tier_and_the_ssd_traffic(tmp_path):
    # A RAM tier of about 20 rows: most of 300 rows are evicted to SSD and read back from there.
    with _store_with_rows(tmp_path / "s", memory_budget="2KiB") as store:
        store.checkpoint()
        before = store.usage()
        assert before.ssd_rows == sum(store.num_rows(t)["ssd"] for t in ("t", "u")) == 307
        assert before.memory_rows == sum(store.num_rows(t)["memory"] for t in ("t", "u")) < 30
        assert before.memory_budget == 2048 and before.memory_bytes <= 2048
        assert before.ssd_rows_written >= 307 and before.ssd_bytes_written > 0 and before.segments >= 2
        assert before.disk_bytes > before.ssd_bytes_written
        np.testing.assert_array_equal(
            store.lookup("t", np.arange(300)).numpy(), np.ones((300, 4), np.float32)
        )
        after = store.usage()
        # Each row stored: weights, Adagrad state, counters (decoded width), as 4-byte words.
        read = after.ssd_bytes_read - before.ssd_bytes_read
        assert read > 0 and read % (4 * store.info("t").layout.words) == 0
        assert after.ssd_read_seconds > before.ssd_read_seconds


def test_usage_counts_the_disk_while_segments_are_removed_under_it(tmp_path, monkeypatch):
    """The pipeline's worker merges and collects segments while ``usage()`` walks the directory: a
    folder or file removed during the walk counts as gone, never raises (as a real pipelined run
    showed: FileNotFoundError from a segment collected mid-walk)."""
    import os

    with _store_with_rows(tmp_path / "s", memory_budget="2KiB") as store:
        store.checkpoint()
        ssd_root = tmp_path / "s" / "segments"
        gone = sorted(p for p in ssd_root.rglob("*") if p.is_dir() and p.parent.parent == ssd_root)[0]
        real_scandir, real_stat = os.scandir, os.stat

        def scandir(path="."):  # the folder listed by the walk's parent vanishes before it is entered
            if os.fspath(path) == os.fspath(gone):
                raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
            return real_scandir(path)

        def stat(path, *args, **kwargs):  # and one file goes after it was listed
            if os.fspath(path).endswith("zarr.json") and "rows" in os.fspath(path):
                raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "scandir", scandir)
        monkeypatch.setattr(os, "stat", stat)
        counted = store.usage().disk_bytes
        monkeypatch.undo()
        everything = sum(p.stat().st_size for p in ssd_root.rglob("*") if p.is_file())
        assert 0 < counted < everything
