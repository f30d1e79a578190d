"""Stores that lost files, or are opened by tools with default settings, lose nothing more.

- a store missing ``checkpoints/`` or ``segments/``, or every checkpoint manifest (a partial
  copy) is refused with ``CorruptStoreError`` and nothing of it is deleted;
- a checkpoint whose arrays of keys pending admission are missing is refused like any array;
- ``keep_checkpoints`` persists with the store: a tool opening it with defaults (``hierps
  shrink``) retires no checkpoint the trainer kept.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import hierps
from hierps import errors

KEYS = np.arange(100, dtype=np.int64)


def _make(path, checkpoints=3, **kwargs):
    with hierps.Store(path, device="cpu", memory_budget="1KiB", **kwargs) as store:
        emb = hierps.Embedding(None, 4, store=store, name="t", admission={"min_count": 3})
        for i in range(checkpoints):
            store.write("t", KEYS, np.full((len(KEYS), 4), i, np.float32))
            ids = torch.tensor([1000 + i])
            with store.run_pass({"t": ids}):  # seen once: pending admission
                emb(ids).sum().backward()
                store.step()
            store.checkpoint()
    return path


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("lost", ["checkpoints", "segments", "manifests"])
def test_a_partial_copy_is_refused_and_nothing_is_deleted(tmp_path, lost):
    path = _make(tmp_path / "s")
    if lost == "manifests":
        for manifest in (path / "checkpoints").glob("*.json"):
            manifest.unlink()
    else:
        shutil.rmtree(path / lost)
    before = _tree(path)
    with pytest.raises(errors.CorruptStoreError, match="partial copy"):
        hierps.Store(path, device="cpu")
    if lost != "segments":  # a reader needs no segments to open
        with pytest.raises(errors.CorruptStoreError, match="partial copy"):
            hierps.CheckpointReader(path)
    assert _tree(path) == before
    with pytest.raises(errors.CorruptStoreError):  # a tool opening it finds the same
        hierps.Store(path, device="cpu")


def test_a_store_that_never_checkpointed_still_opens_empty(tmp_path):
    path = tmp_path / "s"
    with hierps.Store(path, device="cpu", memory_budget="1KiB") as store:
        store.table("t", 4)
        store.write("t", KEYS, np.ones((len(KEYS), 4), np.float32))
        store.flush()
    with hierps.Store(path, device="cpu") as store:
        assert store.checkpoint_id is None and store.tables == {}
    assert list((path / "segments").rglob("rows")) == []  # what no checkpoint named was collected


@pytest.mark.parametrize("array", ["pending_keys", "pending_count", "pending_pass"])
def test_missing_pending_key_arrays_are_reported(tmp_path, array):
    path = _make(tmp_path / "s")
    with hierps.Store(path, device="cpu") as store:
        assert store.num_pending("t") == 3
    shutil.rmtree(path / "checkpoints" / "00000003" / "t" / array)
    with pytest.raises(errors.CorruptStoreError, match=f"{array}.*missing"):
        hierps.Store(path, device="cpu")
    with pytest.raises(errors.CorruptStoreError, match=f"{array}.*missing"):
        hierps.CheckpointReader(path).pending_keys("t")


def test_keep_checkpoints_persists_with_the_store(tmp_path):
    path = _make(tmp_path / "s", checkpoints=8, keep_checkpoints=8)
    with hierps.Store(path, device="cpu") as store:  # defaults: what the store kept
        assert store.keep_checkpoints == 8
        store.checkpoint()
        assert [c["id"] for c in store.list_checkpoints()] == list(range(2, 10))
    with hierps.Store(path, device="cpu", keep_checkpoints=2) as store:  # set: from now on
        store.checkpoint()
        assert [c["id"] for c in store.list_checkpoints()] == [9, 10]
    with hierps.Store(path, device="cpu") as store:
        assert store.keep_checkpoints == 2
    with hierps.Store(tmp_path / "new", device="cpu") as store:
        assert store.keep_checkpoints == 3


def test_hierps_shrink_keeps_the_trainers_checkpoints(tmp_path):
    path = _make(tmp_path / "s", checkpoints=8, keep_checkpoints=8)
    proc = subprocess.run(
        [sys.executable, "-m", "hierps.cli", "shrink", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    with hierps.Store(path, device="cpu") as store:
        assert len(store.list_checkpoints()) == 8
