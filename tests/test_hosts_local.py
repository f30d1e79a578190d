"""Rank directories on each host's own disk, and checkpoints that never cost a tag.

Ranks are threads (:mod:`thread_world`); a "host" is a directory of its own, so that the ranks of
host A and host B open ``<host>/store/rank-NNNNN`` under different roots, as the same path names
another disk on each host. Checkpoints commit without any file the hosts share, reopen exactly,
and a host missing at open is an error naming its parts. Then the tags of a shared directory stay
loadable whatever number of ranks open it, with ``keep_checkpoints=1``, and a plain ``hierps.Store``
refuses one rank's directory. ``tests/test_hosts.py`` runs real hosts (network namespaces).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_sharded_checkpoints import SETTINGS, assert_same, merged, on_ranks, state
from test_sharded_features import ALL_KEYS, TABLES, train
from thread_world import ThreadTransport, run_ranks

import hierps
import hierps.serving
from hierps.cli import main
from hierps.errors import ConfigError, CorruptStoreError, HierpsError, MissingPartsError
from hierps.lifecycle._export import LocalPart, export_store
from hierps.sharding import owner_of
from hierps.storage._commit_log import delete_record, rank_dir, read_records, snapshots

PER_HOST = 2


def host_root(hosts: Path, rank: int) -> Path:
    """The store path rank ``rank`` opens: the same name, on its host's own disk."""
    return hosts / f"host-{rank // PER_HOST}" / "store"


def on_hosts(hosts: Path, world: int, work: Any, **settings: Any) -> list[Any]:
    def rank_main(transport: ThreadTransport) -> Any:
        store = hierps.ShardedStore(host_root(hosts, transport.rank), transport, **{**SETTINGS, **settings})
        try:
            for name, table in TABLES.items():
                store.table(name, 4, **table)
            return work(store)
        finally:
            store.close()

    return run_ranks(world, rank_main)


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """Two hosts of two ranks trained and checkpointed "final" (copy before changing it)."""
    hosts = tmp_path_factory.mktemp("hosts")
    states = on_hosts(hosts, 4, lambda s: (train(s, s.rank, 4), state(s))[1])
    return hosts, merged(states)


def copy_hosts(two_hosts: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    shutil.copytree(two_hosts[0], tmp_path / "hosts")
    return tmp_path / "hosts"


def test_two_hosts_commit_without_a_shared_file_and_reopen_exactly(two_hosts, tmp_path):
    hosts = copy_hosts(two_hosts, tmp_path)
    for h in (0, 1):  # each host holds its own ranks' directories, each with its copy of the record
        root = hosts / f"host-{h}" / "store"
        assert sorted(p.name for p in root.iterdir()) == [rank_dir(root, 2 * h + i).name for i in (0, 1)]
        for r in (2 * h, 2 * h + 1):
            assert [(s.world_size, s.tag) for s in read_records(rank_dir(root, r))] == [(4, "final")]
    assert_same(merged(on_hosts(hosts, 4, state)), two_hosts[1])


def test_ranks_that_died_before_their_copy_of_the_record_reopen_at_it(two_hosts, tmp_path):
    """Rank 0 wrote its copy (the commit point); host B and rank 1 died before theirs."""
    hosts = copy_hosts(two_hosts, tmp_path)
    latest = snapshots(host_root(hosts, 0))[-1]
    for r in (1, 2, 3):
        delete_record(rank_dir(host_root(hosts, r), r), latest.id)
    got = on_hosts(hosts, 4, state)
    assert_same(merged(got), two_hosts[1])
    assert all(s["tags"] == ["final"] for s in got)
    for r in (1, 2, 3):  # the copies are written again as the ranks reopen
        assert [s.id for s in read_records(rank_dir(host_root(hosts, r), r))] == [latest.id]


def test_a_host_missing_at_open_is_an_error_naming_its_parts(two_hosts, tmp_path):
    hosts = copy_hosts(two_hosts, tmp_path)
    shutil.move(hosts / "host-1", tmp_path / "elsewhere")  # host B came back with an empty disk
    before = files(hosts)

    def rank_main(transport: ThreadTransport) -> str:
        with pytest.raises(MissingPartsError) as err:
            hierps.ShardedStore(host_root(hosts, transport.rank), transport, **SETTINGS)
        assert err.value.parts == (2, 3) and err.value.checkpoint == snapshots(host_root(hosts, 0))[-1].id
        return str(err.value)

    messages = run_ranks(4, rank_main)
    for m in messages:  # the same error on every rank
        assert "part 2 (rank 2: rank-00002" in m and "part 3 (rank 3: rank-00003" in m, m
        assert "Nothing was opened, created or deleted" in m
    assert files(hosts) == before  # no rank directory created on the empty host, nothing deleted


def test_fewer_hosts_than_parts_is_an_error_naming_the_missing_ones(two_hosts, tmp_path):
    hosts = copy_hosts(two_hosts, tmp_path)
    before = files(hosts)

    def rank_main(transport: ThreadTransport) -> str:  # host A alone, at two ranks
        with pytest.raises(MissingPartsError) as err:
            hierps.ShardedStore(host_root(hosts, 0), transport, **SETTINGS)
        return str(err.value)

    for m in run_ranks(2, rank_main):
        assert "part 2 (rank 2: rank-00002" in m and "part 3 (rank 3: rank-00003" in m, m
    assert files(hosts) == before


def test_hosts_launched_in_each_others_place_are_told_so(two_hosts, tmp_path):
    hosts = copy_hosts(two_hosts, tmp_path)

    def rank_main(transport: ThreadTransport) -> str:
        swapped = host_root(hosts, (transport.rank + PER_HOST) % 4)  # host A runs ranks 2 and 3
        with pytest.raises(ConfigError) as err:
            hierps.ShardedStore(swapped, transport, **SETTINGS)
        return str(err.value)

    messages = run_ranks(4, rank_main)
    assert "lacks" in messages[0] and "node rank" in messages[0], messages[0]


@pytest.mark.parametrize("world", [2, 3])
def test_parts_on_several_hosts_disks_reshard_over_the_transport(two_hosts, tmp_path, world):
    """4 -> 2 (one rank per host) and 4 -> 3 (two on host A, one on host B): each rank reads only the
    parts its host holds and streams their rows to the new owners; then 4 ranks go back to theirs."""
    hosts = copy_hosts(two_hosts, tmp_path)
    per_host = {2: 1, 3: 2}[world]

    def rank_main(transport: ThreadTransport) -> dict[str, Any]:
        root = hosts / f"host-{min(transport.rank // per_host, 1)}" / "store"
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            return state(store)
        finally:
            store.close()

    got = run_ranks(world, rank_main)
    assert_same(merged(got), two_hosts[1])
    assert all(s["tags"] == ["final", "final"] for s in got)
    back = on_hosts(hosts, 4, state)  # the 4-rank checkpoint is kept: no reshard on the way back
    assert_same(merged(back), two_hosts[1])
    assert back[0]["tags"] == ["final", "final"]  # the saved one and the latest resharded copy


# -- a reshard never costs a tag ----------------------------------------------------------------------
def test_a_tag_stays_loadable_at_every_world_size_with_one_checkpoint_kept(tmp_path):
    """Saved at 1 rank, then loaded at 3, 2 and 3 ranks (each opening reshards once at most)."""
    root = tmp_path / "store"
    ref = merged(on_ranks_kept(root, 1, lambda s: (train(s, 0, 1), s.checkpoint("t2"), state(s))[2]))
    # (world, its checkpoints' world sizes kept after it opened, the rank directories left)
    steps = [(3, [1, 3], 3), (2, [1, 2], 2), (3, [1, 3], 3), (1, [1, 3], 3)]
    for world, worlds, dirs in steps:
        before = {s.id for s in snapshots(root)}
        got = on_ranks_kept(root, world, overwrite_then_restore)
        assert_same(merged(got), ref)
        kept = snapshots(root)
        # The saved tag and the latest resharded copy of it: nothing else is kept, nothing lost.
        assert (
            [s.world_size for s in kept] == worlds and kept[0].tag == "t2" and kept[0].resharded_from is None
        )
        assert all(s.tag == "t2" and s.resharded_from == kept[0].id for s in kept[1:])
        assert len({s.id for s in kept} - before) <= 1  # at most one new checkpoint per opening
        # Directories of a larger world are collected once no kept checkpoint names them.
        assert sorted(p.name for p in root.iterdir()) == [rank_dir(root, r).name for r in range(dirs)]


def overwrite_then_restore(store: hierps.ShardedStore) -> dict[str, Any]:
    """Rows written after opening are dropped by restoring the tag, however many times."""
    store.write("plain", ALL_KEYS, np.full((len(ALL_KEYS), 4), 9.0, np.float32))
    store.restore("t2")
    store.restore("t2")
    return state(store)


def on_ranks_kept(root: Path, world: int, work: Any) -> list[Any]:
    def rank_main(transport: ThreadTransport) -> Any:
        store = hierps.ShardedStore(root, transport, **SETTINGS, keep_checkpoints=1)
        try:
            for name, table in TABLES.items():
                store.table(name, 4, **table)
            return work(store)
        finally:
            store.close()

    return run_ranks(world, rank_main)


def test_one_rank_directory_is_not_a_store_of_its_own(tmp_path, capsys):
    root = tmp_path / "store"
    on_ranks(
        root,
        2,
        lambda s: (s.write("plain", ALL_KEYS, np.ones((len(ALL_KEYS), 4), np.float32)), s.checkpoint("a")),
    )
    before = files(root)
    with pytest.raises(ConfigError, match="one rank's part of the sharded store"):
        hierps.Store(rank_dir(root, 0), **SETTINGS)
    assert main(["shrink", str(rank_dir(root, 1))]) != 0
    with pytest.raises(ConfigError, match="one rank's part of the sharded store"):
        export_store(rank_dir(root, 0), tmp_path / "exp")
    assert main(["export", str(rank_dir(root, 0)), str(tmp_path / "exp")]) != 0
    assert "one rank's part of the sharded store" in capsys.readouterr().err
    assert files(root) == before and not (tmp_path / "exp").exists()
    # The root itself opens at one process, with every rank's rows.
    got = on_ranks(root, 1, lambda s: s.lookup("plain", ALL_KEYS).numpy())[0]
    np.testing.assert_array_equal(got, np.ones((len(ALL_KEYS), 4), np.float32))
    assert (owner_of(ALL_KEYS, 2) == 1).any()


def test_inspect_of_one_hosts_disk_says_which_parts_are_elsewhere(two_hosts, capsys):
    assert main(["inspect", "--no-counts", str(host_root(two_hosts[0], 2))]) == 0
    out = capsys.readouterr().out
    assert "of 4 ranks; parts here: ranks [2, 3]; on other hosts' disks (not here): ranks [0, 1]" in out, out


# -- export and serving without a shared file system --------------------------------------------------
def one_directory(hosts: Path, tmp_path: Path) -> Path:
    """The hosts' rank directories side by side, as one shared file system would hold them."""
    shared = tmp_path / "shared"
    for h in (0, 1):
        shutil.copytree(hosts / f"host-{h}" / "store", shared, dirs_exist_ok=True)
    return shared


def served(path: Path, deltas: list[Path] | None = None) -> dict[str, np.ndarray]:
    with hierps.serving.open(path, deltas) as tables:
        return {t: tables.lookup(t, ALL_KEYS) for t in TABLES}


def held_rows(s: hierps.ShardedStore) -> dict[str, Any]:
    """The weights of every row this rank holds, by key."""
    return {t: {k: r[: s.tables[t].dim] for k, r in rows.items()} for t, rows in state(s)["rows"].items()}


def edit_and_checkpoint(s: hierps.ShardedStore) -> dict[str, Any]:
    """Rows changed, added (keys never seen) and deleted, checkpointed "next"."""
    s.write("plain", ALL_KEYS[::7], np.full((len(ALL_KEYS[::7]), 4), 2.5, np.float32))
    s.write("counted", [10**15 + 1, 10**15 + 2], np.ones((2, 4), np.float32))
    s.shrink("chance", ttl_passes=1)
    s.checkpoint("next")
    return held_rows(s)


def test_an_export_of_parts_on_each_hosts_disk_serves_the_rows_of_one_directory(two_hosts, tmp_path):
    """Each host sees only its ranks' directories: the export is written on one host (rank 0's, then
    host B's for the delta) from rows the other host streams, and serves exactly what the export
    of the same checkpoint from one directory serves, and the rows the ranks hold; so does the
    chain of base and delta."""
    hosts = copy_hosts(two_hosts, tmp_path)
    out = {h: tmp_path / f"host-{h}" / "exports" for h in (0, 1)}

    def rank_main(s: hierps.ShardedStore) -> tuple[Any, ...]:
        full = s.export(out[0] / "final")
        held = held_rows(s)
        after = edit_and_checkpoint(s)
        delta = s.export(out[1] / "delta", since="final", rank=2)
        return full, held, delta, after

    got = on_hosts(hosts, 4, rank_main)
    full, delta = got[0][0], got[0][2]
    assert all(g[0] == full and g[2] == delta for g in got)  # every rank returns the manifest
    assert sorted(p.name for p in out[0].iterdir()) == ["final"] and [p.name for p in out[1].iterdir()] == [
        "delta"
    ]
    assert full["ranks"] == 4 and delta["since"] == full["checkpoint"]
    assert delta["tables"]["chance"]["deleted"] > 0 and delta["tables"]["plain"]["rows"] > 0
    same = ("checkpoint", "since", "seed", "ranks", "store", "checkpoint_created", "since_created")

    # The same checkpoints exported by one process from one directory: the same rows, bit for bit.
    shared = one_directory(hosts, tmp_path)
    ref = export_store(shared, tmp_path / "ref-full", checkpoint="final")
    ref_delta = export_store(shared, tmp_path / "ref-delta", since="final")
    for mine, theirs in ((full, ref), (delta, ref_delta)):  # a delta applies to the same rows
        assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}
    for name, t in full["tables"].items():
        assert {k: t[k] for k in ("rows", "total_rows", "deleted")} == {
            k: ref["tables"][name][k] for k in ("rows", "total_rows", "deleted")
        }
        assert delta["tables"][name]["deleted"] == ref_delta["tables"][name]["deleted"]
    one, many = served(tmp_path / "ref-full"), served(out[0] / "final")
    chain, ref_chain = (
        served(out[0] / "final", [out[1] / "delta"]),
        served(tmp_path / "ref-full", [tmp_path / "ref-delta"]),
    )
    # Copied into one serving directory (as a serving host receives them), base and delta form its chain.
    for export in (out[0] / "final", out[1] / "delta"):
        shutil.copytree(export, tmp_path / "serve" / export.name)
    followed = served(tmp_path / "serve")
    for t in TABLES:
        np.testing.assert_array_equal(many[t], one[t], err_msg=t)
        np.testing.assert_array_equal(chain[t], ref_chain[t], err_msg=t)
        np.testing.assert_array_equal(followed[t], chain[t], err_msg=t)
    # ... and the rows the ranks hold at each checkpoint, exactly.
    for at, rows in ((many, 1), (chain, 3)):
        for t in TABLES:
            mine = {k: v for g in got for k, v in g[rows][t].items()}
            keys = [i for i, k in enumerate(ALL_KEYS.tolist()) if k in mine]
            assert keys, t
            np.testing.assert_array_equal(at[t][keys], np.stack([mine[ALL_KEYS[i]] for i in keys]), err_msg=t)


def test_a_failed_export_fails_on_every_rank_and_leaves_nothing(two_hosts, tmp_path):
    hosts = copy_hosts(two_hosts, tmp_path)
    taken = tmp_path / "taken"
    (taken / "x").mkdir(parents=True)

    def rank_main(s: hierps.ShardedStore) -> str:
        with pytest.raises(HierpsError) as err:
            s.export(taken, rank=3)
        return f"{type(err.value).__name__}: {err.value}"

    messages = on_hosts(hosts, 4, rank_main)
    assert messages[3].startswith("ConfigError") and "already exists and is not empty" in messages[3]
    for m in messages[:3]:  # the others name the rank that failed and its error
        assert "the export failed, so none was written; rank 3: ConfigError" in m, m
    assert [p.name for p in taken.iterdir()] == ["x"] and not list(tmp_path.glob(".taken*"))


def test_one_process_exporting_one_hosts_disk_is_told_which_parts_are_elsewhere(two_hosts, tmp_path):
    before = files(two_hosts[0])
    with pytest.raises(MissingPartsError, match=r"part 2 \(rank 2: rank-00002\), part 3") as err:
        export_store(host_root(two_hosts[0], 0), tmp_path / "exp")
    assert err.value.parts == (2, 3) and "hierps.ShardedStore.export" in str(err.value)
    assert main(["export", str(host_root(two_hosts[0], 0)), str(tmp_path / "exp")]) != 0
    assert not (tmp_path / "exp").exists() and files(two_hosts[0]) == before


def test_a_part_that_fails_to_read_on_the_other_host_fails_the_export_on_every_rank(
    two_hosts, tmp_path, monkeypatch
):
    hosts = copy_hosts(two_hosts, tmp_path)
    rows = LocalPart.rows

    def damaged(self: LocalPart, table: str, dim: int, dtype: str) -> Any:
        if self.path.name == "rank-00003" and table == "plain":
            raise CorruptStoreError(f"{self.path}: segment 1 of table 'plain' fails its checksum")
        return rows(self, table, dim, dtype)

    monkeypatch.setattr(LocalPart, "rows", damaged)

    def rank_main(s: hierps.ShardedStore) -> str:
        with pytest.raises(HierpsError) as err:
            s.export(tmp_path / "exp")
        return f"{type(err.value).__name__}: {err.value}"

    messages = on_hosts(hosts, 4, rank_main)
    assert messages[3].startswith("CorruptStoreError"), messages[3]  # the reader raises its own error
    assert "rank 3, reading part 3, failed to send its rows of table 'plain'" in messages[0], messages[0]
    assert "fails its checksum" in messages[0]
    for m in (messages[1], messages[2]):  # the others name both failed ranks
        assert "the export failed, so none was written; rank 0: HierpsError" in m and "rank 3:" in m, m
    assert not (tmp_path / "exp").exists() and not list(tmp_path.glob(".exp*"))
