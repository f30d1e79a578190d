"""Durable checkpoints: reopen in a new process, restore by tag. (SIGKILL at each fault point: test_crash.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from crash_worker import KEYS

import hierps

HERE = Path(__file__).parent


def _run_worker(store: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("HIERPS_FAULT", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "crash_worker.py"), str(store), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise AssertionError(proc.stderr)


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
