"""Publisher: serving follows a store's checkpoints through deltas, never torn, never going back, under kills."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hierps
import hierps.serving
from hierps.errors import ConfigError
from hierps.online import Publisher

DIM = 4


def make_store(path: Path, keep: int = 5) -> hierps.Store:
    store = hierps.Store(path, keep_checkpoints=keep, seed=1)
    store.table("t", DIM)
    store.table("u", 2)
    return store


def train(store: hierps.Store, step: int) -> None:
    """One 'pass': new and changed rows of both tables, deterministic in ``step``."""
    rng = np.random.default_rng(step)
    for name, dim in (("t", DIM), ("u", 2)):
        keys = np.unique(rng.integers(0, 500, 60)).astype(np.int64)
        store.write(name, keys, rng.standard_normal((len(keys), dim)).astype(np.float32))


def rows_of(store: hierps.Store) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for name in ("t", "u"):
        keys = np.arange(500, dtype=np.int64)
        have = store.has_rows(name, keys)
        out[name] = (keys[have], store.lookup(name, keys[have]).numpy())
    return out


def served(directory: Path) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    tables = hierps.serving.open(directory)
    try:
        out = {}
        for name in ("t", "u"):
            keys = np.sort(tables.keys(name))
            out[name] = (keys, np.asarray(tables.lookup(name, keys)))
        return tables.checkpoint, out
    finally:
        tables.close()


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=name)
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)


def test_each_publish_gives_serving_the_rows_of_the_latest_checkpoint_and_compacts(tmp_path):
    store = make_store(tmp_path / "s")
    out = tmp_path / "serve"
    pub = Publisher(store, out, compact_every=2)
    assert pub.publish() is None  # no checkpoint yet
    follower = None
    seen = []
    for step in range(7):
        train(store, step)
        store.passes = step + 1
        if step == 4:  # deletions are carried: serving must drop the rows unseen in the last pass
            assert sum(store.shrink(ttl_passes=1).values()) > 0
        ckpt = store.checkpoint()
        done = pub.publish()
        assert done is not None and done.checkpoint == ckpt and done.bytes > 0
        assert done.kind == ("base" if step in (0, 3, 6) else "delta")  # a base after every 2 deltas
        assert pub.publish() is None  # serving has it already
        at, rows = served(out)
        assert at == ckpt
        assert_same(rows, rows_of(store))
        if follower is None:
            follower = hierps.serving.open(out, follow=0.05)
        assert follower.wait_for_poll(10)
        seen.append(follower.checkpoint)
    assert seen == sorted(seen) and seen[-1] == ckpt  # following never went back
    follower.close()
    # Two chains at most: the last base's and the one before it (for followers still on it).
    kinds = sorted(p.name.split("-")[0] for p in out.iterdir())
    assert kinds.count("base") == 2 and not any(p.name.startswith(".") for p in out.iterdir())
    store.close()


def test_a_chain_whose_checkpoint_was_retired_gets_a_new_base_never_a_wrong_delta(tmp_path):
    store = make_store(tmp_path / "s", keep=1)
    out = tmp_path / "serve"
    pub = Publisher(store, out, compact_every=10)
    train(store, 0)
    store.checkpoint()
    assert pub.publish().kind == "base"
    for step in (1, 2):  # the published checkpoint is retired by keep_checkpoints=1
        train(store, step)
        store.checkpoint()
    done = pub.publish()
    assert done.kind == "base"
    assert_same(served(out)[1], rows_of(store))
    store.close()
    # Another store in the same directory: its rows are not a delta of the first one's.
    other = make_store(tmp_path / "other")
    train(other, 9)
    other.checkpoint()
    assert Publisher(other, out).publish().kind == "base"
    assert_same(served(out)[1], rows_of(other))
    other.close()


def test_the_schedule_and_bad_settings(tmp_path):
    store = make_store(tmp_path / "s")
    with pytest.raises(ConfigError, match="every_passes or every_seconds, not both"):
        Publisher(store, tmp_path / "a", every_passes=1, every_seconds=1)
    with pytest.raises(ConfigError, match="compact_every: expected an int >= 1"):
        Publisher(store, tmp_path / "a", compact_every=0)
    with pytest.raises(ConfigError, match="every_passes: expected an int >= 1"):
        Publisher(store, tmp_path / "a", every_passes=0)
    with pytest.raises(ConfigError, match="every_seconds: expected a number > 0"):
        Publisher(store, tmp_path / "a", every_seconds=-1.0)
    with pytest.raises(ConfigError, match="dtype: expected 'fp32' or 'fp16'"):
        Publisher(store, tmp_path / "a", dtype="bf16")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").mkdir()
    (foreign / "x" / "data.bin").write_bytes(b"1")
    with pytest.raises(ConfigError, match="is not a serving directory of this store's exports"):
        Publisher(store, foreign)
    pub = Publisher(store, tmp_path / "b", every_passes=2)
    assert not pub.due()
    for _ in range(2):
        store.begin_pass([])
        store.end_pass()
    assert pub.due()
    store.close()


# -- kills -------------------------------------------------------------------------------------------
WORKER = """
import os, sys
sys.path.insert(0, {tests!r})
import test_online_publish as t
from hierps.online import Publisher
import hierps.lifecycle._export as export, hierps.online._publish as publish

when, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
real = os.replace
def replace(a, b):  # a kill just before or just after the rename onto a name that starts with ``name``
    hit = os.path.basename(str(b)).startswith(name)
    if hit and when == "before":
        os._exit(9)
    real(a, b)
    if hit and when == "after":
        os._exit(9)
os.replace = replace
store = t.make_store(t.Path({store!r}))
pub = Publisher(store, {out!r}, compact_every=2)  # bases at checkpoints 1, 4, 7
for step in range(store.passes, steps):
    t.train(store, step)
    store.passes = step + 1
    store.checkpoint()
    pub.publish()
store.close()
"""


# The first base, a delta, a checkpoint's manifest, a compaction (the new base, then the old chain
# renamed out of view to be removed), each just before and just after its rename.
KILLS = [
    ("before", "base-0000000001"),
    ("after", "base-0000000001"),
    ("before", "delta-0000000002"),
    ("after", "delta-0000000003"),
    ("before", "00000003.json"),
    ("before", "base-0000000007"),
    ("after", "base-0000000007"),
    ("before", ".base-0000000001.tmp"),
    ("after", ".delta-0000000002.tmp"),
]


@pytest.mark.parametrize(("when", "name"), KILLS)
def test_a_publisher_killed_around_any_rename_restarts_and_serving_is_never_torn_or_older(
    tmp_path, when, name
):
    store_dir, out = tmp_path / "s", tmp_path / "serve"
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent), store=str(store_dir), out=str(out)))
    run = subprocess.run(
        [sys.executable, str(script), when, name, "8"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 9, run.stderr[-2000:]
    before = (
        served(out)[0] if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()) else None
    )
    run = subprocess.run(
        [sys.executable, str(script), "-", "-", "8"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    at, rows = served(out)
    assert before is None or at >= before  # never older than what was served before the kill
    store = make_store(store_dir)
    assert at == store.list_checkpoints()[-1]["id"]
    assert_same(rows, rows_of(store))
    assert not any(p.name.startswith(".") for p in out.iterdir())  # what the kill left is gone
    store.close()


# -- a sharded store ---------------------------------------------------------------------------------
def test_a_sharded_store_publishes_collectively_one_export_written_by_rank_0(tmp_path):
    from thread_world import ThreadTransport, run_ranks

    out = tmp_path / "serve"
    steps = 4

    def rank_main(transport: ThreadTransport) -> list[tuple[str, int, int]]:
        store = hierps.ShardedStore(tmp_path / "s", transport, seed=1)
        try:
            store.table("t", DIM)
            store.table("u", 2)
            pub = Publisher(store, out, compact_every=2)
            done = []
            for step in range(steps):
                train(store, step)  # every rank the same rows; each keeps those it owns
                ckpt = store.checkpoint()
                published = pub.publish()  # collective
                assert published is not None and published.checkpoint == ckpt
                done.append((published.kind, published.checkpoint, published.bytes))
                assert pub.publish() is None
            return done
        finally:
            store.close()

    results = run_ranks(2, rank_main)
    assert [k for k, _, _ in results[0]] == ["base", "delta", "delta", "base"]
    assert [c for _, c, _ in results[0]] == [c for _, c, _ in results[1]]  # every rank agreed
    assert all(b > 0 for _, _, b in results[0]) and all(b == 0 for _, _, b in results[1])  # rank 0 wrote
    # The rows served are the last write of every key, whichever rank owns it.
    want: dict[str, dict[int, np.ndarray]] = {"t": {}, "u": {}}
    for step in range(steps):
        rng = np.random.default_rng(step)
        for name, dim in (("t", DIM), ("u", 2)):
            keys = np.unique(rng.integers(0, 500, 60)).astype(np.int64)
            want[name] |= dict(zip(keys.tolist(), rng.standard_normal((len(keys), dim)).astype(np.float32)))
    at, rows = served(out)
    assert at == results[0][-1][1]
    for name in ("t", "u"):
        keys = np.array(sorted(want[name]), dtype=np.int64)
        np.testing.assert_array_equal(rows[name][0], keys)
        np.testing.assert_array_equal(rows[name][1], np.stack([want[name][k] for k in keys.tolist()]))


# -- the staleness measurement -----------------------------------------------------------------------
def test_measure_staleness_runs_the_loop_and_reports_each_publish(tmp_path):
    from hierps.bench.online import measure_staleness

    result = measure_staleness(
        tables=1,
        rows=2000,
        dim=4,
        passes=4,
        batches=2,
        batch_size=64,
        compact_every=2,
        follow=0.05,
        directory=str(tmp_path),
    )
    assert [r["kind"] for r in result["passes"]] == ["base", "delta", "delta", "base"]
    assert all(r["bytes"] > 0 and r["staleness_s"] >= 0 for r in result["passes"])
    assert result["summary"]["delta_bytes"] > 0
    with pytest.raises(ConfigError, match="rows"):
        measure_staleness(rows=0)
