"""A reshard writes the rows each new owner receives once, in key order, straight to its SSD tier;
into a world size that divides the old one, each rank adopts its old parts' segments whole.

Ranks are threads (:mod:`thread_world`). Rows written at 2 ranks (whole rows: weights, optimizer
state and counters, in fp32 and in fp16 / bf16 precisions) are read back bit for bit at 3 ranks,
each rank's part of a table one segment written once (no RAM tier, spill or compaction), and at 1,
the old parts' segments linked in: not a row written, and the old parts' files outlive the links.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from thread_world import ThreadTransport, run_ranks

import hierps
from hierps._store import store_parts
from hierps.sharding import _commits, owner_of
from hierps.storage._commit_log import rank_dir
from hierps.tiers._reader import CheckpointReader

DIM = 4
ROWS = 60_000  # parts of several merge buffers each
TABLES = {
    "wide": {"optimizer": "adagrad"},
    "compact": {"optimizer": "adam", "weights_dtype": "fp16", "state_dtype": "bf16"},
}
SETTINGS = {"device": "cpu", "memory_budget": "1MiB", "pipeline": True}


def _keys() -> np.ndarray:
    """Keys spread over int64, negatives included, shuffled."""
    rng = np.random.default_rng(3)
    return rng.permutation(np.unique(rng.integers(-(2**62), 2**62, ROWS + 100, dtype=np.int64))[:ROWS])


def _rows(store: hierps.ShardedStore, name: str, keys: np.ndarray) -> np.ndarray:
    """Whole decoded rows for ``keys``: random weights, non-negative optimizer state and counters."""
    info = store.tables[name]
    rows = np.abs(np.random.default_rng(len(keys)).standard_normal((len(keys), info.width), dtype=np.float32))
    rows[::2, :DIM] *= -1
    return rows


def _written(root: Path, ranks: int = 2, rows: int = ROWS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rows written at ``ranks`` ranks and checkpointed -> per table, every key and its stored row
    (decoded: rounded to the table's precisions)."""
    keys = _keys()[:rows]

    def write(transport: ThreadTransport) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            mine = keys[owner_of(keys, ranks) == transport.rank]
            for name, settings in TABLES.items():
                store.table(name, DIM, **settings)
                store.local.write_rows(name, mine, _rows(store, name, mine))
            store.checkpoint("two")
            return {name: (mine, _whole(store, name, mine)) for name in TABLES}
        finally:
            store.close()

    parts = run_ranks(ranks, write)
    return {
        name: (np.concatenate([p[name][0] for p in parts]), np.concatenate([p[name][1] for p in parts]))
        for name in TABLES
    }


def _whole(store: hierps.ShardedStore, name: str, keys: np.ndarray) -> np.ndarray:
    """The stored rows of ``keys`` (owned by this rank), every column, decoded."""
    return store_parts(store.local).core.whole_rows(name, keys)


@pytest.fixture(scope="module")
def written(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]]:
    root = tmp_path_factory.mktemp("reshard") / "s"
    return root, _written(root)


@pytest.mark.parametrize("world", [3, 1])
def test_a_reshard_gives_every_row_bit_identical_each_part_one_segment_written_once(
    written: tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]],
    tmp_path: Path,
    world: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rounds of one merge buffer per rank (about 8,700 rows here): many rounds, each rank's bound
    # cutting the others' buffers.
    monkeypatch.setattr(_commits, "_ROUND_BYTES", 1)
    source, rows = written
    root = tmp_path / "s"
    shutil.copytree(source, root)

    def reopen(transport: ThreadTransport) -> dict[str, object]:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            core = store_parts(store.local).core
            got = {}
            for name, (keys, expected) in rows.items():
                mine = owner_of(keys, world) == transport.rank
                got[name] = (
                    _whole(store, name, keys[mine]).view(np.uint32),
                    expected[mine].view(np.uint32),
                    len(core.ssd.runs(name)),
                    store.num_rows(name)["ssd"],
                    int(mine.sum()),
                )
            return {
                "tables": got,
                "ssd_rows_written": core.ssd.rows_written,
                "memory": core.memory.bytes_used,
                "links": _link_counts(store.local.path / "segments"),
            }
        finally:
            store.close()

    for rank, part in enumerate(run_ranks(world, reopen)):
        total = 0
        for name, (got, expected, segments, held, owned) in part["tables"].items():  # type: ignore[union-attr]
            np.testing.assert_array_equal(got, expected, err_msg=f"table {name}, rank {rank} of {world}")
            assert held == owned and (segments == 1 or world == 1), (name, rank, held, owned, segments)
            total += owned
        if world == 1:
            # Both old parts adopted: rank 0's own segments gone back to, rank 1's linked in (each of
            # their files has a second name now); not a row written.
            assert part["ssd_rows_written"] == 0
            assert 2 in part["links"] and set(part["links"]) == {1, 2}, part["links"]  # type: ignore[operator]
        else:
            # Every row written once, as one segment per table: nothing through the RAM tier and spilled.
            assert part["ssd_rows_written"] == total
    # Back at 2 ranks: the saved checkpoint, as written.
    back = run_ranks(2, lambda t: _reread(root, t, rows))
    assert all(back)


def _assert_rows(
    store: hierps.ShardedStore, rows: dict[str, tuple[np.ndarray, np.ndarray]], world: int, rank: int
) -> None:
    """``store`` (rank ``rank`` of ``world``) holds exactly the written rows it owns, bit for bit."""
    for name, (keys, expected) in rows.items():
        mine = owner_of(keys, world) == rank
        np.testing.assert_array_equal(
            _whole(store, name, keys[mine]).view(np.uint32),
            expected[mine].view(np.uint32),
            err_msg=f"table {name}, rank {rank} of {world}",
        )


def _link_counts(segments: Path) -> set[int]:
    """The link counts of the files of a store's segments."""
    return {
        os.stat(os.path.join(d, f)).st_nlink
        for d, _, names in os.walk(segments)
        if "/." not in d
        for f in names
    }


def test_adopted_segments_read_and_reshard_again_and_their_files_outlive_either_side(
    written: tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]], tmp_path: Path
) -> None:
    """2 -> 1 adopts rank 1's segments; those links read exact at 3 ranks (streamed from them), back
    at 1 (the resharded checkpoint), and once merged away and retired at 1 the old part's files still
    hold checkpoint "two" exactly: a retired link is unlinked, never cut."""
    source, rows = written
    root = tmp_path / "s"
    shutil.copytree(source, root)
    settings = {**SETTINGS, "keep_checkpoints": 20}

    def at(world: int, then=None):  # type: ignore[no-untyped-def]
        def run(transport: ThreadTransport) -> None:
            store = hierps.ShardedStore(root, transport, **settings)
            try:
                _assert_rows(store, rows, world, transport.rank)
                if then is not None:
                    then(store)
            finally:
                store.close()

        run_ranks(world, run)

    at(1)  # adopted
    at(3)  # streamed from the adopted segments (read through their own tags)

    def merge_and_retire(store: hierps.ShardedStore) -> None:
        core = store_parts(store.local).core
        for name in rows:
            core.ssd.compact(name, rewrite=[s for _, s in core.ssd.segments(name)])
            assert len(core.ssd.segments(name)) == 1
        _assert_rows(store, rows, 1, 0)
        store.checkpoint("merged")
        store.local.retire_checkpoints(keep=[core.checkpoint_id])
        assert _link_counts(store.local.path / "segments") == {1}  # every link retired, none left

    at(1, merge_and_retire)  # back to the resharded checkpoint at 1 (no reshard), then merged
    # Rank 1's part of "two", read from its own files: every row as written.
    two = next(s for s in _commits.snapshots(root) if s.tag == "two")
    with CheckpointReader(rank_dir(root, 1), two.parts[1]) as reader:
        for name, (keys, expected) in rows.items():
            mine = owner_of(keys, 2) == 1
            order = np.argsort(keys[mine])
            got = np.concatenate([r for _, r in reader.iter_rows(name)])
            np.testing.assert_array_equal(got.view(np.uint32), expected[mine][order].view(np.uint32))


def test_four_ranks_reshard_into_two_by_adopting_two_parts_each(tmp_path: Path) -> None:
    """4 -> 2: rank r goes back to its part r and links part r + 2 in; every row exact, none
    written; back at 4 ranks the saved checkpoint as written."""
    root = tmp_path / "s"
    rows = _written(root, ranks=4, rows=12_000)

    def reopen(transport: ThreadTransport) -> int:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            _assert_rows(store, rows, 2, transport.rank)
            assert _link_counts(store.local.path / "segments") == {1, 2}
            return store_parts(store.local).core.ssd.rows_written
        finally:
            store.close()

    assert run_ranks(2, reopen) == [0, 0]

    def back(transport: ThreadTransport) -> None:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            _assert_rows(store, rows, 4, transport.rank)
        finally:
            store.close()

    run_ranks(4, back)


def _reread(root: Path, transport: ThreadTransport, rows: dict[str, tuple[np.ndarray, np.ndarray]]) -> bool:
    store = hierps.ShardedStore(root, transport, **SETTINGS)
    try:
        _assert_rows(store, rows, 2, transport.rank)
        return [c["tag"] for c in store.list_checkpoints()][0] == "two"
    finally:
        store.close()


def test_a_part_that_fails_to_read_fails_the_reshard_with_every_scan_ended(
    written: tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each old part is scanned on a thread of its own; when one part's scan fails, the reshard fails
    with its error and every other part's scan has ended (none reads on after the error)."""
    import threading

    from hierps.tiers._reader import CheckpointReader

    source, _ = written
    root = tmp_path / "s"
    shutil.copytree(source, root)
    real = CheckpointReader.iter_rows

    def rows_of(self: CheckpointReader, table: str):  # type: ignore[no-untyped-def]
        for keys, rows in real(self, table):  # in pieces of 100 rows; part 1 fails after its fifth
            for at in range(0, len(keys), 100):
                if at == 500 and self.path.name.endswith("1"):
                    raise OSError(f"{self.path}: a read failed")
                yield keys[at : at + 100], rows[at : at + 100]

    monkeypatch.setattr(CheckpointReader, "iter_rows", rows_of)
    # Parts that cannot be linked in (another file system) are streamed, at 1 rank too.
    monkeypatch.setattr(_commits, "_can_link", lambda source, into: False)
    with pytest.raises(OSError, match="a read failed"):
        run_ranks(1, lambda t: hierps.ShardedStore(root, t, **SETTINGS).close())
    monkeypatch.undo()
    monkeypatch.setattr(CheckpointReader, "iter_rows", rows_of)
    with (
        hierps.sharding.streamed_reshards(),
        pytest.raises(OSError, match="a read failed"),
    ):  # asked to stream
        run_ranks(1, lambda t: hierps.ShardedStore(root, t, **SETTINGS).close())
    assert not [t for t in threading.enumerate() if t.name == "hierps-made-beside"]


def test_a_probe_left_by_a_killed_process_does_not_stop_the_adoption(
    written: tuple[Path, dict[str, tuple[np.ndarray, np.ndarray]]], tmp_path: Path
) -> None:
    source, rows = written
    root = tmp_path / "s"
    shutil.copytree(source, root)
    (rank_dir(root, 0) / ".link-probe").write_bytes(b"left")  # as a kill between link and unlink leaves it

    def reopen(transport: ThreadTransport) -> int:
        store = hierps.ShardedStore(root, transport, **SETTINGS)
        try:
            return store_parts(store.local).core.ssd.rows_written
        finally:
            store.close()

    assert run_ranks(1, reopen) == [0]  # adopted: no row written
    assert not (rank_dir(root, 0) / ".link-probe").exists()
