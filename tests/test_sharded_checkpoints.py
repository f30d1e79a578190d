"""Checkpoints of a sharded store agree across ranks, whatever number of ranks reads them later.

Ranks are threads (:mod:`thread_world`). A store trained by some ranks is reopened by another
number of them (resharded as it opens: rows, optimizer state, counters, keys pending admission and
the pass counter), exported (from the checkpoint committed for all ranks, never from a part that
did not commit nor from a rank directory it does not name), and taken over by one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_sharded_features import ALL_KEYS, TABLES, train
from thread_world import ThreadTransport, run_ranks

import hierps
import hierps.serving
from hierps._store import store_parts
from hierps.cli import main
from hierps.errors import ConfigError, StoreFormatError
from hierps.lifecycle._export import export_store
from hierps.lifecycle._inspection import inspect_path
from hierps.sharding import owner_of
from hierps.storage._commit_log import opening_part, rank_dir, snapshots, write_record
from hierps.storage._files import write_json_atomic
from hierps.tiers._reader import CheckpointReader

SETTINGS: dict[str, Any] = {"device": "cpu", "memory_budget": "2KiB"}


def state(store: hierps.ShardedStore) -> dict[str, Any]:
    """What this rank holds: full rows of the keys it owns that have one, its keys pending
    admission, passes."""
    owned = ALL_KEYS[owner_of(ALL_KEYS, store.world_size) == store.rank]
    held = {t: owned[store.local.has_rows(t, owned)] for t in TABLES}
    return {
        "rows": {t: dict(zip(held[t].tolist(), store.local.read_rows(t, held[t]))) for t in TABLES},
        "pending": {t: store_parts(store.local).core.pending_keys[t].arrays() for t in TABLES},
        "passes": store.local.passes,
        "steps": {t: store.tables[t].step for t in TABLES},
        "tags": [c["tag"] for c in store.list_checkpoints()],
    }


def on_ranks(root: Path, world: int, work: Any) -> list[dict[str, Any]]:
    """Open the store on ``world`` rank threads, run ``work(store)`` on each -> their results."""

    def rank_main(transport: ThreadTransport) -> dict[str, Any]:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            for name, settings in TABLES.items():
                store.table(name, 4, **settings)
            return work(store)
        finally:
            store.close()

    return run_ranks(world, rank_main)


def merged(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' states as one: every row by key, every pending key's arrays sorted by key."""
    out: dict[str, Any] = {"rows": {t: {} for t in TABLES}, "pending": {}}
    for s in states:
        for t in TABLES:
            out["rows"][t].update(s["rows"][t])
    for t in TABLES:
        arrays = {k: np.concatenate([s["pending"][t][k] for s in states]) for k in states[0]["pending"][t]}
        order = np.argsort(arrays["pending_keys"])
        out["pending"][t] = {k: v[order] for k, v in arrays.items()}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A store two ranks trained with every feature (admission, counters, eviction), checkpoint "final"."""
    root = tmp_path_factory.mktemp("sharded") / "store"
    states = on_ranks(root, 2, lambda s: (train(s, s.rank, 2), state(s))[1])
    return root, merged(states)


def copy_of(trained: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    shutil.copytree(trained[0], tmp_path / "store")
    return tmp_path / "store"


def assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    for t in TABLES:
        assert got["rows"][t].keys() == ref["rows"][t].keys()
        for k, row in ref["rows"][t].items():
            np.testing.assert_array_equal(got["rows"][t][k], row, err_msg=f"{t} key {k}")
        for name, values in ref["pending"][t].items():
            np.testing.assert_array_equal(got["pending"][t][name], values, err_msg=f"{t} {name}")


@pytest.mark.parametrize("world", [1, 3])
def test_another_number_of_ranks_opens_every_row_counter_and_pending_key(trained, tmp_path, world):
    root = copy_of(trained, tmp_path)
    states = on_ranks(root, world, state)
    assert any(len(p["pending_keys"]) for p in trained[1]["pending"].values())  # admission has counts
    for rank, s in enumerate(states):  # each rank counts the keys it owns now
        for t in TABLES:
            assert (owner_of(s["pending"][t]["pending_keys"], world) == rank).all()
    assert_same(merged(states), trained[1])
    assert all(s["passes"] == 3 and s["tags"] == ["final", "final"] for s in states)
    assert [s.world_size for s in snapshots(root)] == [2, world]
    assert len({str(s["steps"]) for s in states}) == 1
    # ... and back to two ranks: still the same rows.
    assert_same(merged(on_ranks(root, 2, state)), trained[1])


def test_export_reads_the_checkpoint_committed_for_all_ranks(trained, tmp_path):
    root = copy_of(trained, tmp_path)
    on_ranks(root, 3, lambda s: s.checkpoint("three"))  # resharded into 3 ranks, then saved by them
    first = snapshots(root)[-1]
    assert (first.world_size, first.tag, first.resharded_from) == (3, "three", None)

    def more(store: hierps.ShardedStore) -> dict[str, Any]:  # two ranks train on, then "next"
        train(store, store.rank, 2)
        out = {t: store.lookup(t, torch.from_numpy(ALL_KEYS)).numpy() for t in TABLES}
        # Then rank 0 alone checkpoints its part of a checkpoint that never commits.
        store.write("plain", ALL_KEYS[:4], np.full((4, 4), 7.0, np.float32))
        if store.rank == 0:
            store.local.checkpoint("torn", extra={"world_size": 2, "rank": 0}, retire=False)
        return out

    rows = on_ranks(root, 2, more)[0]  # rank-00002 now holds only an older checkpoint's part
    manifest = export_store(root, tmp_path / "exp")
    assert manifest["ranks"] == 2 and manifest["checkpoint"] == snapshots(root)[-1].id
    report = inspect_path(root)  # the same two parts
    assert [(s["path"], s["checkpoint"]) for s in report["stores"]] == [
        (str(rank_dir(root, r)), p) for r, p in enumerate(snapshots(root)[-1].parts)
    ]
    with hierps.serving.open(tmp_path / "exp") as view:
        for t in TABLES:
            np.testing.assert_array_equal(view.lookup(t, ALL_KEYS), rows[t], err_msg=t)
    # An older checkpoint of 3 ranks exports too; no delta between checkpoints of 2 and 3 ranks.
    assert export_store(root, tmp_path / "old", checkpoint=first.id)["ranks"] == 3
    with pytest.raises(ConfigError, match="written by 3 ranks and checkpoint .* by 2"):
        export_store(root, tmp_path / "delta", since=first.id)
    # A key stored by two ranks at one committed checkpoint (files tampered with) is refused.
    rank0 = snapshots(root)[-1].parts[0]
    key = CheckpointReader(rank_dir(root, 0), rank0).keys("plain")[:1]
    with opening_part(), hierps.Store(rank_dir(root, 1), **SETTINGS) as store:
        store.table("plain", 4)
        store.write("plain", key, np.zeros((1, 4), np.float32))
        part = store.checkpoint(extra={"world_size": 2, "rank": 1})
    write_record(root, [rank0, part], "tampered")
    with pytest.raises(StoreFormatError, match="is stored in both rank-00000 and rank-00001"):
        export_store(root, tmp_path / "exp2")


def test_a_directory_of_rank_stores_without_a_committed_checkpoint_is_not_exported(tmp_path):
    root = tmp_path / "job"
    with hierps.Store(rank_dir(root, 1), **SETTINGS) as store:  # a part, never committed
        store.table("t", 4)
        store.write("t", [1, 2], np.ones((2, 4), np.float32))
        store.checkpoint(extra={"world_size": 2, "rank": 1})
    with pytest.raises(ConfigError, match="no checkpoint at all committed for all ranks"):
        export_store(root, tmp_path / "exp")


def test_cli_shrink_of_rank_stores_commits_one_checkpoint_for_all_ranks(trained, tmp_path, capsys):
    root = copy_of(trained, tmp_path)
    assert main(["shrink", str(root), "--ttl-passes", "1"]) == 0
    assert "rows deleted" in capsys.readouterr().out
    assert [(s.world_size, s.tag) for s in snapshots(root)][-1] == (2, "shrink")
    # The oracle: the two ranks shrinking the same copy themselves.
    (tmp_path / "ranks").mkdir()
    other = copy_of(trained, tmp_path / "ranks")
    ref = merged(on_ranks(other, 2, lambda s: (s.shrink(ttl_passes=1), s.checkpoint("shrink"), state(s))[2]))
    assert sum(len(r) for r in ref["rows"].values()) < sum(len(r) for r in trained[1]["rows"].values())
    assert_same(merged(on_ranks(root, 2, state)), ref)


def test_a_directory_an_earlier_hierps_wrote_opens_at_its_checkpoint(trained, tmp_path):
    """Commit records in ``<root>/commits`` (one directory all ranks shared), none in the rank
    directories: each rank adopts its records as it opens, and nothing is rolled back."""
    root = copy_of(trained, tmp_path)
    legacy = root / "commits"
    legacy.mkdir()
    for snap in snapshots(root):
        body = snap.to_json()
        del body["stores"], body["resharded_from"]
        write_json_atomic(legacy / f"{snap.id:08d}.json", body)
    for rank in (0, 1):
        shutil.rmtree(rank_dir(root, rank) / "commits")
    assert_same(merged(on_ranks(root, 2, state)), trained[1])
    assert [s.tag for s in snapshots(root)] == ["final"]
