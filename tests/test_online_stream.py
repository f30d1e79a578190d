"""ParquetStream: batches equal to what was written, passes by count and by event time, exact resume,
files that arrive, and clear errors naming the file for torn, foreign, late and out-of-order logs."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import hierps
from hierps.errors import ConfigError, LogFileError
from hierps.integrations.loader import PassLoader
from hierps.online import ParquetStream

ROWS = 300  # per file


def write(
    directory: Path, k: int, rows: int = ROWS, *, seconds: float = 30.0, name: str | None = None
) -> Path:
    """File ``k`` of the log: ids ``k * rows ..`` in ``id``, event times 30 s per file in ``ts``."""
    first = k * rows
    table = pa.table(
        {
            "id": pa.array(np.arange(first, first + rows, dtype=np.int64)),
            "ts": pa.array(1000.0 + k * seconds + np.arange(rows) * (seconds / rows)),
            "tags": pa.array([[i, i + 1] for i in range(first, first + rows)], pa.list_(pa.int64())),
        }
    )
    final = directory / (name or f"part-{k:04d}.parquet")
    tmp = directory / f"_tmp-{final.name}"
    pq.write_table(table, tmp, row_group_size=128)
    os.replace(tmp, final)
    return final


def logs(tmp_path: Path, files: int = 3) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    for k in range(files):
        write(d, k)
    return d


def drain(stream: ParquetStream) -> list[tuple[list[int], bool, int, str]]:
    return [
        (b["id"].tolist(), stream.last_of_pass(), stream.pass_index, json.dumps(stream.state_dict()))
        for b in stream
    ]


PASSES = [{"pass_examples": 250}, {"pass_seconds": 20.0, "time_column": "ts"}]


@pytest.mark.parametrize("passes", PASSES, ids=["count", "time"])
def test_the_stream_gives_every_row_once_in_order_and_resumes_exactly_at_any_batch(tmp_path, passes):
    d = logs(tmp_path)
    whole = drain(ParquetStream(d, batch_size=64, **passes))
    assert [i for ids, *_ in whole for i in ids] == list(range(3 * ROWS))  # across files and row groups
    sizes: dict[int, int] = {}
    for ids, _, p, _ in whole:
        assert len(ids) <= 64
        sizes[p] = sizes.get(p, 0) + len(ids)
    if "pass_examples" in passes:
        assert list(sizes.values()) == [250, 250, 250, 150]
    else:  # 20 s of logs: 200 rows, from t = 1000 (a multiple of 20)
        assert list(sizes.values()) == [200] * 4 + [100]
    assert [last for _, last, *_ in whole] == [
        i + 1 == len(whole) or whole[i + 1][2] != p for i, (_, _, p, _) in enumerate(whole)
    ]
    for k, (*_, state) in enumerate(whole):
        again = ParquetStream(d, batch_size=64, **passes)
        again.load_state_dict(json.loads(state))
        assert [row[:3] for row in drain(again)] == [row[:3] for row in whole[k + 1 :]], k


def columns(stream: ParquetStream) -> list[tuple[dict[str, list[Any]], bool, int, str]]:
    """Every column of every batch (a list column as its values and offsets), its pass, and the
    stream's state after it."""
    out = []
    for b in stream:
        got = {k: [t.tolist() for t in v] if isinstance(v, tuple) else v.tolist() for k, v in b.items()}
        out.append((got, stream.last_of_pass(), stream.pass_index, json.dumps(stream.state_dict())))
    return out


@pytest.mark.parametrize("passes", PASSES, ids=["count", "time"])
def test_a_resumed_stream_gives_every_column_of_the_uninterrupted_one_from_any_state(tmp_path, passes):
    d = logs(tmp_path)
    stream = ParquetStream(d, batch_size=64, **passes)
    start = json.dumps(stream.state_dict())  # before any batch: the start
    whole = columns(stream)
    states = [start] + [state for *_, state in whole]
    written = pq.read_table(d).to_pydict()  # the files as written, in name order
    assert [i for b, *_ in whole for i in b["id"]] == written["id"]
    assert [t for b, *_ in whole for t in b["ts"]] == written["ts"]
    assert [v for b, *_ in whole for v in b["tags"][0]] == [v for tags in written["tags"] for v in tags]
    for k, state in enumerate(states):  # every batch, pass and file boundary
        again = ParquetStream(d, batch_size=64, **passes)
        again.load_state_dict(json.loads(state))
        assert columns(again) == whole[k:], k


def test_batches_hold_the_columns_as_tensors(tmp_path):
    d = logs(tmp_path, 1)
    batch = next(iter(ParquetStream(d, batch_size=10, pass_examples=100)))
    assert batch["id"].dtype == torch.int64 and torch.equal(batch["id"], torch.arange(10))
    values, offsets = batch["tags"]
    assert values.tolist() == [v for i in range(10) for v in (i, i + 1)] and offsets.tolist() == list(
        range(0, 20, 2)
    )
    only = next(iter(ParquetStream(d, batch_size=10, columns=["id"], pass_examples=100)))
    assert list(only) == ["id"]


def test_files_renamed_into_place_while_waiting_are_read_and_others_ignored(tmp_path):
    d = logs(tmp_path, 1)
    (d / "_SUCCESS").write_text("")
    (d / ".part-0001.parquet").write_bytes(b"half a file")
    (d / "_tmp-part-0001.parquet").write_bytes(b"half a file")
    (d / "notes.txt").write_text("not a log")
    assert (
        len([i for ids, *_ in drain(ParquetStream(d, batch_size=100, pass_examples=100)) for i in ids])
        == ROWS
    )

    def later() -> None:
        time.sleep(0.3)
        write(d, 1)

    thread = threading.Thread(target=later)
    thread.start()
    got = drain(ParquetStream(d, batch_size=100, pass_examples=100, wait=5, poll_seconds=0.05))
    thread.join()
    assert [i for ids, *_ in got for i in ids] == list(range(2 * ROWS))


def test_a_stream_that_ended_goes_on_with_files_that_arrive_later(tmp_path):
    d = logs(tmp_path, 1)
    stream = ParquetStream(d, batch_size=100, pass_examples=100)
    assert len(drain(stream)) == 3 and drain(stream) == []  # at the end: nothing more
    write(d, 1)
    assert [i for ids, *_ in drain(stream) for i in ids] == list(range(ROWS, 2 * ROWS))


def test_torn_foreign_late_and_out_of_order_files_name_the_file(tmp_path):
    d = logs(tmp_path, 2)
    (d / "part-0002.parquet").write_bytes(b"PAR1 torn")
    with pytest.raises(LogFileError, match=r"part-0002.parquet: not a readable Parquet file .*torn"):
        drain(ParquetStream(d, batch_size=100, pass_examples=100))
    pq.write_table(pa.table({"user": [1, 2]}), d / "part-0002.parquet")
    with pytest.raises(LogFileError, match=r"part-0002.parquet: a foreign file: it has no column 'id'"):
        drain(ParquetStream(d, batch_size=100, pass_examples=100))
    pq.write_table(pa.table({"id": [1.5], "ts": [2000.0], "tags": [[1]]}), d / "part-0002.parquet")
    with pytest.raises(LogFileError, match=r"part-0002.parquet: a foreign file: column 'id' is double"):
        drain(ParquetStream(d, batch_size=100, pass_examples=100))
    (d / "part-0002.parquet").unlink()

    stream = ParquetStream(d, batch_size=100, pass_examples=100)
    drain(stream)
    state = stream.state_dict()
    write(d, 5, name="part-0000a.parquet")  # sorts before the position: it would never be read
    with pytest.raises(
        LogFileError, match=r"part-0000a.parquet: arrived after the stream had read past its place"
    ):
        drain(stream)
    with pytest.raises(LogFileError, match=r"2 log files now sort before it where 1 did"):  # nor at a restart
        ParquetStream(d, batch_size=100, pass_examples=100).load_state_dict(state)
    (d / "part-0000a.parquet").unlink()

    backwards = tmp_path / "backwards"
    backwards.mkdir()
    write(backwards, 1)
    write(backwards, 0, name="part-0009.parquet")  # earlier event times in a later file
    with pytest.raises(LogFileError, match=r"part-0009.parquet: the event time 'ts' decreases"):
        drain(ParquetStream(backwards, batch_size=100, pass_seconds=10.0, time_column="ts"))


def test_bad_settings_and_a_lost_position_file_are_clear(tmp_path):
    d = logs(tmp_path, 1)
    with pytest.raises(ConfigError, match="give one of pass_examples"):
        ParquetStream(d)
    with pytest.raises(ConfigError, match="name the event-time column"):
        ParquetStream(d, pass_seconds=10)
    with pytest.raises(ConfigError, match="batch_size: expected an int >= 1"):
        ParquetStream(d, batch_size=0, pass_examples=10)
    with pytest.raises(ConfigError, match="no column 'nope'"):
        next(iter(ParquetStream(d, columns=["nope"], pass_examples=10)))
    stream = ParquetStream(d, batch_size=100, pass_examples=100)
    next(iter(stream))
    state = stream.state_dict()
    (d / "part-0000.parquet").unlink()
    with pytest.raises(LogFileError, match="part-0000.parquet: the stream position is in this file"):
        ParquetStream(d, batch_size=100, pass_examples=100).load_state_dict(state)


def test_an_fsspec_url_is_a_source(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for k in range(2):
        fs.pipe(f"/logs-{os.getpid()}/part-{k:04d}.parquet", write(tmp_path, k).read_bytes())
    got = drain(ParquetStream(f"memory:///logs-{os.getpid()}", batch_size=128, pass_examples=128))
    assert [i for ids, *_ in got for i in ids] == list(range(2 * ROWS))


def test_a_pass_loader_over_the_stream_announces_its_passes_and_resumes_with_the_store(tmp_path):
    d = logs(tmp_path)
    store = hierps.Store(tmp_path / "s")
    store.table("t", 4)
    loader = PassLoader(
        ParquetStream(d, batch_size=64, pass_seconds=20.0, time_column="ts"), {"t": "id"}, store
    )
    seen = []
    for i, batch in enumerate(loader):
        seen.append((batch["id"].tolist(), loader.at_pass_end, store.passes))
        if i == 6:
            store.checkpoint("mid")
    assert store.passes == 5 and [at for _, at, _ in seen].count(True) == 5
    store.restore("mid")  # the stream goes back with the store
    rest = [(b["id"].tolist(), loader.at_pass_end, store.passes) for b in loader]
    assert rest == seen[7:]
    store.close()


def test_at_two_ranks_each_takes_its_share_of_the_same_batches_and_passes(tmp_path):
    d = logs(tmp_path)
    one = drain(ParquetStream(d, batch_size=128, columns=["id"], pass_examples=250))
    ranks = [
        drain(ParquetStream(d, batch_size=64, columns=["id"], pass_examples=250, rank=r, world_size=2))
        for r in (0, 1)
    ]
    assert len(ranks[0]) == len(ranks[1]) == len(one)  # as many steps on every rank
    for whole, r0, r1 in zip(one, *ranks):
        assert sorted(r0[0] + r1[0]) == whole[0] and r0[0] == whole[0][0::2] and r1[0] == whole[0][1::2]
        assert r0[1:] == r1[1:] == whole[1:]  # the same pass ends, pass indexes and positions
    with pytest.raises(ConfigError, match=r"rank: expected an int in \[0, 2\)"):
        ParquetStream(d, pass_examples=10, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="column 'tags' holds lists"):
        next(iter(ParquetStream(d, batch_size=8, pass_examples=10, rank=0, world_size=2)))
