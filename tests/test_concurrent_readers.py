"""Readers open a store while another process trains in it: they see a committed checkpoint,
whole, or a clear CheckpointRetiredError when the trainer retired it under them, never a mix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import crash_scenario as cs
import numpy as np
import pytest

import hierps
import hierps.storage._checkpoint
import hierps.tiers._ssd
from hierps.errors import CheckpointRetiredError
from hierps.rows._counters import NUM_COUNTERS
from hierps.tiers._reader import CheckpointReader


@pytest.fixture
def fast_dir(tmp_path) -> Path:
    with cs.tmpfs_dir("hierps-readers-", tmp_path) as path:
        yield path


def _read_all(reader: CheckpointReader) -> dict[str, str]:
    """Digest of every stored row of every table, as cs.checkpoint_loop logs it."""
    out = {}
    for table in cs.TABLES:
        keys = reader.keys(table)
        found, rows = reader.read(table, keys)
        assert found.all()
        # Store.read_rows (what the trainer logs) gives weights and optimizer state, not counters.
        out[table] = cs.digest(keys, np.ascontiguousarray(rows[:, : rows.shape[1] - NUM_COUNTERS]))
    return out


def test_readers_during_training_see_whole_checkpoints(fast_dir):
    path, out = fast_dir / "store", fast_dir / "writer"
    rounds = 25
    writer = cs.start_forked(cs.checkpoint_loop, path, out, fault=str(rounds))
    seen: list[tuple[int, str, dict[str, str]]] = []
    retired = 0
    log = out / "log.jsonl"
    try:
        # A slow reader: opened on an early checkpoint, reading after the trainer retired it.
        while not (log.exists() and log.read_text().count("\n") >= 1) and writer.is_alive():
            time.sleep(0.01)
        slow = CheckpointReader(path)
        while writer.is_alive() and log.read_text().count("\n") < slow.checkpoint_id + 2:
            time.sleep(0.01)
        if log.read_text().count("\n") >= slow.checkpoint_id + 2:
            with pytest.raises(CheckpointRetiredError, match=f"checkpoint {slow.checkpoint_id} was retired"):
                _read_all(slow)
        # Readers opened and read back to back while the trainer goes on.
        while writer.is_alive():
            try:
                reader = CheckpointReader(path)
                seen.append((reader.checkpoint_id, reader.manifest["tag"], _read_all(reader)))
            except CheckpointRetiredError:
                retired += 1
    finally:
        writer.join(120)
    assert writer.exitcode == 0, (
        (out / "error.txt").read_text() if (out / "error.txt").exists() else writer.exitcode
    )
    logged = {e["id"]: e for e in map(json.loads, log.read_text().splitlines())}
    assert len(logged) == rounds
    reader = CheckpointReader(path)  # after training: the last checkpoint
    seen.append((reader.checkpoint_id, reader.manifest["tag"], _read_all(reader)))
    for ckpt, tag, digests in seen:
        assert logged[ckpt]["tag"] == tag
        assert logged[ckpt]["digest"] == digests, f"checkpoint {ckpt} read back differs from what was written"
    assert len({c for c, _, _ in seen}) >= 2, f"readers saw only {seen[0][0]}"
    print(
        f"{len(seen)} consistent reads of {len({c for c, _, _ in seen})} checkpoints, {retired} retired mid-read"
    )


@pytest.fixture
def trainer(fast_dir):
    """A store keeping one checkpoint, and a function that trains one more round and checkpoints."""
    store, bags = cs.open_store(fast_dir / "store")
    rounds = iter(range(1000))

    def step() -> int:
        cs.train(store, bags, seed=next(rounds), passes=1)
        return store.checkpoint()

    step()
    yield store, step
    store.close()


def test_read_after_the_checkpoint_was_retired_and_collected(trainer):
    store, step = trainer
    reader = CheckpointReader(store.path)
    first = reader.checkpoint_id
    step()
    step()  # retires `first` and deletes the segments only it used
    with pytest.raises(
        CheckpointRetiredError, match=f"checkpoint {first} was retired .* newest is now {first + 2}"
    ):
        reader.read("user", reader.keys("user"))
    with pytest.raises(CheckpointRetiredError):
        next(reader.iter_rows("item"))
    fresh = CheckpointReader(store.path)
    assert fresh.checkpoint_id == first + 2
    np.testing.assert_array_equal(
        fresh.read("user", fresh.keys("user"))[1][:, :-NUM_COUNTERS],
        store.read_rows("user", fresh.keys("user")),
    )


def test_checkpoint_retired_while_the_reader_opens_it(trainer, monkeypatch):
    """The reader listed checkpoint k, then the trainer retired it: the reader takes the newest."""
    store, step = trainer
    real = hierps.tiers._ssd.SsdTier.load_segments
    calls = []

    def racing(self, *args, **kwargs):
        if not calls:
            step()  # commits k + 1, retires k, collects its segments
        calls.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(hierps.tiers._ssd.SsdTier, "load_segments", racing)
    first = store.checkpoint_id
    reader = CheckpointReader(store.path)
    assert calls and reader.checkpoint_id == first + 1
    for table in cs.TABLES:
        keys = reader.keys(table)
        np.testing.assert_array_equal(
            reader.read(table, keys)[1][:, :-NUM_COUNTERS], store.read_rows(table, keys)
        )
    # Asked for that very checkpoint by id, the reader says it is gone.
    calls.clear()
    with pytest.raises(CheckpointRetiredError, match=f"checkpoint {first + 1} was retired"):
        CheckpointReader(store.path, ref=first + 1)


def test_checkpoint_retired_in_the_middle_of_a_read(trainer, monkeypatch):
    """Segments deleted between two segment reads: the rows already read are not returned."""
    store, step = trainer
    step()  # a second round: the checkpoint's rows of "user" lie in two segments, read one by one
    reader = CheckpointReader(store.path)
    real = hierps.tiers._ssd.read_arrays
    taken = []

    def racing(requests, *args, **kwargs):
        for out in real(requests, *args, **kwargs):
            taken.append(1)
            if len(taken) == 2:  # after the first array read of the first segment
                step()
                step()
            yield out

    monkeypatch.setattr(hierps.tiers._ssd, "read_arrays", racing)
    with pytest.raises(CheckpointRetiredError):
        reader.read("user", reader.keys("user"))
    assert len(taken) >= 2
