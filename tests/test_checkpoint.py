"""Durable checkpoints: reopen in a new process, and SIGKILL at every step of a checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from crash_worker import KEYS

import hierps

HERE = Path(__file__).parent


def _run_worker(store: Path, out: Path, fault: str | None = None) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    env.pop("HIERPS_FAULT", None)
    if fault:
        env["HIERPS_FAULT"] = fault
    proc = subprocess.run([sys.executable, str(HERE / "crash_worker.py"), str(store), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    if fault is None and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run: its rows after each checkpoint."""
    root = tmp_path_factory.mktemp("reference")
    _run_worker(root / "store", root)
    return root


def test_reopen_in_new_process_restores_rows_and_optimizer_state(reference):
    store = hierps.Store(reference / "store", device="cpu")
    try:
        assert [c["tag"] for c in store.list_checkpoints()] == ["first", "second"]
        rows = store.read_rows("t", KEYS)
        assert rows.shape == (len(KEYS), 4 + 8)  # adam: weights, m, v
        np.testing.assert_array_equal(rows, np.load(reference / "ref2.npy"))
        assert store.tables["t"].step == 24
        assert store.tables["t"].optimizer.type == "adam"
    finally:
        store.close()


def test_restore_by_tag_returns_to_earlier_rows(reference, tmp_path):
    import shutil

    shutil.copytree(reference / "store", tmp_path / "store")
    store = hierps.Store(tmp_path / "store", device="cpu")
    try:
        store.restore("first")
        np.testing.assert_array_equal(store.read_rows("t", KEYS), np.load(reference / "ref1.npy"))
        assert store.tables["t"].step == 12
        store.restore("second")
        np.testing.assert_array_equal(store.read_rows("t", KEYS), np.load(reference / "ref2.npy"))
    finally:
        store.close()


# Points before the second manifest is committed reopen at the first checkpoint; after, at the second.
FAULTS_BEFORE = [
    "pass.write_back:4",
    "ssd.segment_keys_written:12",
    "checkpoint.after_device_flush:2",
    "ssd.segment_keys_written:8",
    "checkpoint.after_memory_flush:2",
    "ssd.compaction:2",
    "checkpoint.after_sync:2",
    "checkpoint.index_table:2",
    "checkpoint.before_manifest:2",
]
FAULTS_AFTER = ["checkpoint.after_manifest:2"]


@pytest.mark.parametrize("fault", FAULTS_BEFORE + FAULTS_AFTER)
def test_sigkill_reopens_at_last_complete_checkpoint(reference, tmp_path, fault):
    rc, err = _run_worker(tmp_path / "store", tmp_path, fault)
    assert rc == -signal.SIGKILL, f"the worker was not killed at {fault}: {err[-3000:]}"
    expected = "ref2.npy" if fault in FAULTS_AFTER else "ref1.npy"
    store = hierps.Store(tmp_path / "store", device="cpu")
    try:
        assert (tmp_path / "ref1.npy").exists(), "the fault fired before the first checkpoint"
        np.testing.assert_array_equal(store.read_rows("t", KEYS), np.load(reference / expected))
        # Nothing of the interrupted work is left on disk: every segment is named by a checkpoint.
        on_disk = {(p.parent.name, int(p.name)) for p in (tmp_path / "store" / "segments").glob("*/*") if p.name.isdigit()}
        assert on_disk <= store.catalog.referenced_segments()
        # Training goes on from the restored rows.
        bag = hierps.EmbeddingBag(None, 4, mode="sum", store=store, name="t")
        bag(torch.from_numpy(KEYS[:6]), torch.tensor([0, 3])).sum().backward()
        store.step()
        store.checkpoint()
    finally:
        store.close()
