"""Sharded store over 2 ranks on localhost: equal to 1 rank, under torchrun and horovodrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import finished

from hierps.integrations.rendezvous import free_port

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
WORKER = str(HERE / "dist_worker.py")
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HIERPS_FAULT"):
        env.pop(k, None)
    return env


def torchrun(n: int, *args: str) -> None:
    cmd = [
        str(BIN / "torchrun"),
        f"--nproc_per_node={n}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        *args,
    ]
    proc = finished(cmd, _env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _load(out: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(out / name) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("one")
    torchrun(1, "train", str(root / "store"), str(root))
    return root


def _assert_same_training(a: dict, b: dict) -> None:
    # Two ranks sum each gradient in another order than one rank; Adagrad's g / sqrt(sum g^2)
    # magnifies that last-bit rounding for rows with tiny accumulators, hence 1e-4, not 1e-6.
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b["rows"], a["rows"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b["dense"], a["dense"], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """A store two ranks trained (under torchrun) and checkpointed as "final"; copy it before changing it."""
    root = tmp_path_factory.mktemp("two")
    torchrun(2, "train", str(root / "store"), str(root))
    return root


def test_two_ranks_torchrun_equal_one_rank(one_rank, two_ranks):
    ref = _load(one_rank, "result-0.npz")
    for rank in (0, 1):
        got = _load(two_ranks, f"result-{rank}.npz")
        _assert_same_training(ref, got)
        assert got["ssd_read"] > 0  # the RAM budget forced rows through the SSD tier
        assert got["rows_fetched"] == 0  # every announced mini-batch: rows only, no keys
        assert got["bytes_sent"] > 0
    assert sorted(p.name for p in (two_ranks / "store").iterdir()) == ["rank-00000", "rank-00001"]


def test_two_ranks_horovodrun_equal_one_rank(one_rank, tmp_path):
    pytest.importorskip("horovod.torch", reason="Horovod is installed by `make horovod` (make test runs it)")
    cmd = [
        str(BIN / "horovodrun"),
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        WORKER,
        "train",
        str(tmp_path / "store"),
        str(tmp_path),
        "--transport",
        "horovod",
    ]
    proc = finished(cmd, _env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = _load(one_rank, "result-0.npz")
    for rank in (0, 1):
        got = _load(tmp_path, f"result-{rank}.npz")
        _assert_same_training(ref, got)
        assert got["rows_fetched"] == 0  # routed once per pass over Horovod too


def _full_rows(out: Path, prefix: str, ranks: int, key_field: str, row_field: str) -> dict[int, np.ndarray]:
    rows: dict[int, np.ndarray] = {}
    for r in range(ranks):
        d = _load(out, f"{prefix}-{r}.npz")
        rows.update({int(k): v for k, v in zip(d[key_field], d[row_field])})
    return rows


def test_checkpoint_of_two_ranks_loads_into_one_and_back(one_rank, two_ranks, tmp_path):
    shutil.copytree(two_ranks / "store", tmp_path / "store")
    written = _full_rows(two_ranks, "result", 2, "owned_keys", "owned_rows")
    torchrun(1, "load", str(tmp_path / "store"), str(tmp_path))
    loaded = _full_rows(tmp_path, "loaded", 1, "keys", "rows")
    assert loaded.keys() == written.keys()
    for k, v in written.items():
        np.testing.assert_array_equal(loaded[k], v)  # weights and adagrad state, exactly
    # ... and 1 -> 2: the one-rank job's checkpoint into two ranks.
    store2 = tmp_path / "from-one"
    shutil.copytree(one_rank / "store", store2)
    torchrun(2, "load", str(store2), str(tmp_path))
    single = _full_rows(one_rank, "result", 1, "owned_keys", "owned_rows")
    split = _full_rows(tmp_path, "loaded", 2, "keys", "rows")
    assert split.keys() == single.keys()
    for k, v in single.items():
        np.testing.assert_array_equal(split[k], v)
    assert _load(tmp_path, "loaded-1.npz")["step"] == 16


def test_another_number_of_ranks_opens_every_trained_row(two_ranks, tmp_path):
    """Opened by 3 ranks, then by 2 again, without restore(): the store reshards as it opens."""
    store = tmp_path / "store"
    shutil.copytree(two_ranks / "store", store)
    trained = _load(two_ranks, "result-0.npz")["rows"]
    written = _full_rows(two_ranks, "result", 2, "owned_keys", "owned_rows")
    for world, worlds in ((3, [2, 3]), (2, [2, 3])):  # back at 2: the saved checkpoint, no reshard
        torchrun(world, "reopen", str(store), str(tmp_path))
        for rank in range(world):
            got = _load(tmp_path, f"reopened-{rank}.npz")
            np.testing.assert_array_equal(got["rows"], trained)  # never an initializer row
            np.testing.assert_array_equal(got["worlds"], worlds)
        full = _full_rows(tmp_path, "reopened", world, "keys", "full")
        assert full.keys() == written.keys()
        for k, v in written.items():
            np.testing.assert_array_equal(full[k], v)  # weights and adagrad state, exactly


def test_killed_rank_makes_the_other_fail_fast(tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **_env(),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, "train", str(tmp_path / "store"), str(tmp_path), "--die-after", "5"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    t0 = time.monotonic()
    _, err = procs[0].communicate(timeout=90)
    elapsed = time.monotonic() - t0
    procs[1].wait(timeout=30)
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0
    assert "PeerLostError" in err and "A peer rank died or stopped answering" in err, err[-2000:]
    assert elapsed < 60
