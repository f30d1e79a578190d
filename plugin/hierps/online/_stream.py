"""A stream of Parquet log files as training input, cut into passes by example count or event time.

Ads models train on logs that keep arriving, in passes ("a pass = 10 minutes of logs"): the
paper's loop. :class:`ParquetStream` reads the files of a directory (local, or any fsspec URL) in
sorted name order, as mini-batches of tensors, and says where each pass ends
(:meth:`ParquetStream.last_of_pass`), so that :class:`hierps.PassLoader` announces each pass to the
store ahead of time. Its position (the file, the row, the pass) is its ``state_dict()``: JSON that
a checkpoint keeps, so a restarted trainer goes on at the next example, with the same batches and
the same pass boundaries.

Files that are still being written are never read. The convention is write-then-rename: a
producer writes ``_tmp-part-00007.parquet`` (or ``.part-00007.parquet``) and renames it to
``part-00007.parquet`` once complete. Names starting with ``.`` or ``_`` are ignored (``_SUCCESS``
markers as well), and so is every name that does not end in ``.parquet``. Names must sort in the
order the logs were written (zero-padded counters or timestamps).
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hierps.errors import ConfigError, LogFileError

__all__ = ["ParquetStream"]

_FORMAT = 1


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:  # pragma: no cover - pyarrow is in the online extra
        raise ConfigError(
            "ParquetStream needs pyarrow: pip install hierps[online] (or pip install pyarrow fsspec)."
        ) from exc
    return pyarrow


@dataclass
class _Cut:
    """A batch cut from the stream, with the position after it."""

    batch: dict[str, Any]
    file: str  # the file and row of the example after it
    row: int
    pass_index: int
    into_pass: int  # examples of its pass up to and including this batch
    pass_start: float | None  # the event time its pass began at (time passes)
    final: bool = False  # the last batch of its pass


class ParquetStream:
    """Mini-batches of a directory of Parquet files that keep arriving, cut into passes.

    Args:
        source: a directory (a local path, or an fsspec URL such as ``"s3://logs/clicks"`` or
            ``"memory://logs"``), or a list of files (fixed: nothing arrives).
        batch_size: examples per batch (the last batch of a pass, or of the stream, may have fewer).
        columns: the columns a batch holds (default: every column of the first file).
        pass_examples: a pass is this many examples; or
        pass_seconds: a pass is the examples whose ``time_column`` lies in ``[start, start + T)``,
            ``start`` a multiple of T (so the boundaries are the same after a restart);
        time_column: the event time in seconds (a number) or a Parquet timestamp; it must not
            decrease along the stream.
        wait: when no file is left: ``False`` ends the stream, ``True`` waits for the next one, a
            number waits that many seconds for one, then ends.
        poll_seconds: how often the directory is listed while waiting.
        filesystem: an fsspec filesystem for ``source`` (default: from its URL).
        rank / world_size: at several data-parallel ranks, each rank's stream gives it every
            ``world_size``-th example of batches of ``batch_size * world_size`` cut together (so
            every rank gets as many batches, in the same passes; ``pass_examples`` counts all
            ranks' examples). Every rank's position is the same.

    Batches are ``{column: tensor}``: numbers and booleans as 1-D tensors, timestamps as int64 in
    their unit, lists of integers as ``(values, offsets)``; other types are refused. A batch never
    holds examples of two passes. The last batch of a pass is yielded once the stream has seen the
    example after it (or its end), so that :meth:`last_of_pass` is known.

    The stream is its position: iterating it again goes on from where it is (after the stream
    ended, with ``wait=False``, it yields nothing more). :meth:`state_dict` / :meth:`load_state_dict`
    save and restore the position after the batch last yielded.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int = 1024,
        columns: Sequence[str] | None = None,
        *,
        pass_examples: int | None = None,
        pass_seconds: float | None = None,
        time_column: str | None = None,
        wait: bool | float = False,
        poll_seconds: float = 1.0,
        filesystem: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        _pyarrow()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size: expected an int >= 1. Got {batch_size!r} instead.")
        if (pass_examples is None) == (pass_seconds is None):
            raise ConfigError("ParquetStream: give one of pass_examples (examples per pass) or pass_seconds.")
        if pass_examples is not None and (
            isinstance(pass_examples, bool) or not isinstance(pass_examples, int) or pass_examples < 1
        ):
            raise ConfigError(f"pass_examples: expected an int >= 1. Got {pass_examples!r} instead.")
        if pass_seconds is not None:
            if (
                isinstance(pass_seconds, bool)
                or not isinstance(pass_seconds, (int, float))
                or not pass_seconds > 0
            ):
                raise ConfigError(f"pass_seconds: expected a number > 0. Got {pass_seconds!r} instead.")
            if time_column is None:
                raise ConfigError("pass_seconds: name the event-time column with time_column=.")
        if not (isinstance(wait, bool) or (isinstance(wait, (int, float)) and wait >= 0)):
            raise ConfigError(f"wait: expected True, False or seconds >= 0. Got {wait!r} instead.")
        if (
            isinstance(poll_seconds, bool)
            or not isinstance(poll_seconds, (int, float))
            or not poll_seconds > 0
        ):
            raise ConfigError(f"poll_seconds: expected a number > 0. Got {poll_seconds!r} instead.")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size: expected an int >= 1. Got {world_size!r} instead.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"rank: expected an int in [0, {world_size}). Got {rank!r} instead.")
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self._cut_size = batch_size * world_size  # the ranks' batches are cut together, then dealt out
        self.columns = list(columns) if columns is not None else None
        self.pass_examples = pass_examples
        self.pass_seconds = float(pass_seconds) if pass_seconds is not None else None
        self.time_column = time_column
        self.wait = wait
        self.poll_seconds = float(poll_seconds)
        self._fs, self._root, self._files = _open_source(source, filesystem)
        self._schema: Any = None  # the first file's, that every file must have
        # The position after the batch last yielded.
        self._file: str | None = None  # None: before the first file
        self._row = 0
        self._pass = 0
        self._into = 0  # examples of the pass so far
        self._start: float | None = None
        self._ended = True  # the batch last yielded ended its pass (or none was yielded)
        self._last_time = -np.inf
        self._known: set[str] = set()  # names listed at or before the position
        self._row_counts: dict[str, int] = {}  # rows of the files read so far

    # -- the pass protocol of hierps.PassLoader -------------------------------------------------
    def last_of_pass(self) -> bool:
        """Whether the batch last yielded is the last of its pass."""
        return self._ended

    @property
    def pass_index(self) -> int:
        """The pass of the batch last yielded (0 for the first)."""
        return self._pass

    # -- position ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the batch last yielded: JSON values only."""
        return {
            "format": _FORMAT,
            "file": self._file,
            "row": self._row,
            "pass_index": self._pass,
            "into_pass": self._into,
            "pass_start": self._start,
            "pass_ended": self._ended,
            "last_time": None if self._last_time == -np.inf else float(self._last_time),
            # How many log files sorted before the position's: one more at a restart arrived late.
            "files_before": len([n for n in self._known if self._file is not None and n < self._file]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on after the batch the state was taken after; ``LogFileError`` when its file is gone."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ConfigError(
                f"ParquetStream.load_state_dict: expected a state of its state_dict() (format {_FORMAT}). "
                f"Got {str(state)[:120]}."
            )
        file = state["file"]
        names = self._list()
        if file is not None and file not in names:
            raise LogFileError(
                f"{self._path(file)}: the stream position is in this file, which is no longer there: the "
                "logs were moved or cleaned up. Restore the file, or start the stream afresh."
            )
        self._file, self._row = file, int(state["row"])
        self._pass, self._into = int(state["pass_index"]), int(state["into_pass"])
        self._start = state["pass_start"]
        self._ended = bool(state["pass_ended"])
        self._last_time = -np.inf if state["last_time"] is None else float(state["last_time"])
        self._known = set()
        if file is not None and self._files is None:
            before = [n for n in names if n < file]
            if len(before) > int(state.get("files_before", len(before))):
                raise LogFileError(
                    f"{self._path(file)} is where the stream stopped, but {len(before)} log files now sort before it "
                    f"where {state['files_before']} did: a file arrived while the stream was stopped in a place it "
                    "had read past, and would never be read. Name log files so that later ones sort later."
                )
            self._known = {*before, file}

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        for cut in self._cuts():
            self._file, self._row, self._pass = cut.file, cut.row, cut.pass_index
            self._into, self._ended = cut.into_pass, bool(cut.final)
            self._start = None if cut.pass_start is None else float(cut.pass_start)
            yield cut.batch

    def _cuts(self) -> Iterator[_Cut]:
        """The batches from the position on, each with the position after it.

        A batch ends at ``batch_size`` examples, or where its pass ends: ``pass_examples`` reached, or
        the first example at or past the pass's end time (seen before the batch is given out, so a
        full batch waits for the example after it to say whether it ends its pass)."""
        pass_index, into, start = self._pass, self._into, self._start
        if self._ended and (self._file is not None or into):  # the next example begins a pass
            pass_index, into, start = pass_index + 1, 0, None
        count, seconds = self.pass_examples, self.pass_seconds
        last_time = self._last_time
        pieces: list[Any] = []  # record batches of the batch being cut
        size = 0
        ready: _Cut | None = None  # a full batch, waiting to know whether it ends its pass
        file, row = self._file or "", self._row
        for chunk, file, row in self._chunks():
            times = self._times(chunk, file, last_time) if seconds is not None else None
            n, offset = chunk.num_rows, 0
            while offset < n:
                if times is not None and start is None:
                    assert seconds is not None
                    start = float(np.floor(times[offset] / seconds) * seconds)
                new_pass = (count is not None and into >= count) or (
                    times is not None
                    and start is not None
                    and seconds is not None
                    and times[offset] >= start + seconds
                )
                if ready is not None:
                    ready.final = new_pass
                    yield ready
                    ready = None
                if new_pass:
                    if pieces:  # a short batch: its pass is over
                        yield _Cut(
                            self._batch(pieces, file), file, row + offset, pass_index, into, start, True
                        )
                        pieces, size = [], 0
                    pass_index, into, start = pass_index + 1, 0, None
                    continue
                take = min(self._cut_size - size, n - offset)
                if count is not None:
                    take = min(take, count - into)
                if times is not None and start is not None and seconds is not None:
                    take = min(take, int(np.searchsorted(times, start + seconds, side="left")) - offset)
                pieces.append(chunk.slice(offset, take))
                size, into, offset = size + take, into + take, offset + take
                if times is not None:
                    last_time = float(times[offset - 1])
                self._last_time = last_time
                if count is not None and into >= count:  # the pass is full: known at once
                    yield _Cut(self._batch(pieces, file), file, row + offset, pass_index, into, start, True)
                    pieces, size = [], 0
                elif size == self._cut_size:
                    ready = _Cut(self._batch(pieces, file), file, row + offset, pass_index, into, start)
                    pieces, size = [], 0
            row += n
        if ready is not None:  # the stream's end ends the pass
            ready.final = True
            yield ready
        if pieces:
            yield _Cut(self._batch(pieces, file), file, row, pass_index, into, start, True)

    def _times(self, chunk: Any, file: str, last: float) -> np.ndarray:
        """The event times of ``chunk``'s rows in seconds; ``LogFileError`` where they decrease."""
        pa = _pyarrow()
        column = chunk.column(self.time_column)
        if pa.types.is_timestamp(column.type):
            unit = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[column.type.unit]
            times = column.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64) * unit
        else:
            times = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        if len(times) and (times[0] < last or bool(np.any(np.diff(times) < 0))):
            raise LogFileError(
                f"{self._path(file)}: the event time {self.time_column!r} decreases (pass_seconds needs logs in "
                "time order, within and across files). Sort each file, and name the files in time order."
            )
        return times

    def _chunks(self) -> Iterator[tuple[Any, str, int]]:
        """``(record batch, its file, the file's row it begins at)`` from the position on, file after
        file in name order; when none is left, wait as ``wait`` says."""
        file, row = self._file, self._row
        waited_since = time.monotonic()
        while True:
            names = self._list()
            self._check_late(names, file)
            if file is not None:
                rows = self._rows(file)
                if row < rows:
                    yield from self._read(file, row)
                    row, waited_since = rows, time.monotonic()
            later = [n for n in names if file is None or self._after(n, file, names)]
            if later:
                file, row = later[0], 0
                self._known.update(n for n in names if not self._after(n, file, names))
                continue
            if self.wait is False or (self.wait is not True and time.monotonic() - waited_since >= self.wait):
                return
            time.sleep(self.poll_seconds)

    def _after(self, name: str, current: str, names: list[str]) -> bool:
        if self._files is not None:  # a list: its own order
            return names.index(name) > names.index(current) if current in names else True
        return name > current

    def _check_late(self, names: list[str], file: str | None) -> None:
        """``LogFileError`` for a file that arrived after the stream passed its place in name order."""
        if file is None or self._files is not None:
            return
        if not self._known:
            self._known = {n for n in names if n <= file}
            return
        late = sorted(n for n in names if n < file and n not in self._known)
        if late:
            raise LogFileError(
                f"{self._path(late[0])}: arrived after the stream had read past its place in name order (it "
                f"is at {file!r}); it would never be read. Name log files so that later ones sort later "
                "(zero-padded counters or timestamps), and rename each into place only when it is complete."
            )

    # -- files ---------------------------------------------------------------------------------------
    def _list(self) -> list[str]:
        """The complete log files: their names (in the directory: sorted)."""
        if self._files is not None:
            return list(self._files)
        try:
            entries = self._fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(str(e).rstrip("/")) for e in entries)
        return sorted(n for n in names if n.endswith(".parquet") and not n.startswith((".", "_")))

    def _path(self, name: str) -> str:
        return name if self._files is not None else posixpath.join(self._root, name)

    @contextmanager
    def _open(self, name: str) -> Iterator[Any]:
        """The Parquet file ``name``, its schema checked against the first file's; closed after."""
        pa = _pyarrow()
        try:
            handle = self._fs.open(self._path(name), "rb")
        except OSError as exc:
            raise LogFileError(f"{self._path(name)}: cannot be opened ({exc}).") from exc
        with handle:
            try:
                pf = pa.parquet.ParquetFile(handle)
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise LogFileError(
                    f"{self._path(name)}: not a readable Parquet file ({exc}): torn (renamed into place before it "
                    "was complete) or not a log file. Write each file under a name starting with '_' and rename "
                    "it once complete; move foreign files out of the directory."
                ) from exc
            schema = pf.schema_arrow
            if self._schema is None:
                self._schema = _selected(schema, self.columns, self.time_column, self._path(name))
            else:
                _check_schema(schema, self._schema, self._path(name))
            self._row_counts[name] = int(pf.metadata.num_rows)
            yield pf

    def _rows(self, name: str) -> int:
        """Rows of ``name``: read once (a file renamed into place does not change), not at every poll."""
        if name not in self._row_counts:
            with self._open(name):
                pass
        return self._row_counts[name]

    def _read(self, name: str, row: int) -> Iterator[tuple[Any, str, int]]:
        """Record batches of ``name`` from ``row`` on, a row group's piece at a time (bounded memory)."""
        with self._open(name) as pf:
            yield from self._batches_of(pf, name, row)

    def _batches_of(self, pf: Any, name: str, row: int) -> Iterator[tuple[Any, str, int]]:
        pa = _pyarrow()
        columns = list(self._schema.names)
        first, begin = 0, 0
        meta = pf.metadata
        while first < meta.num_row_groups and begin + meta.row_group(first).num_rows <= row:
            begin += meta.row_group(first).num_rows
            first += 1
        at = begin
        try:
            batches = pf.iter_batches(
                batch_size=max(self.batch_size, 1 << 16),
                row_groups=range(first, meta.num_row_groups),
                columns=columns,
                use_threads=False,
            )
            for batch in batches:
                skip = max(0, row - at)
                if skip < batch.num_rows:
                    yield (batch.slice(skip) if skip else batch), name, at + skip
                at += batch.num_rows
        except pa.ArrowException as exc:
            raise LogFileError(
                f"{self._path(name)}: a part of it could not be read ({exc}): torn or damaged."
            ) from exc

    def _batch(self, pieces: list[Any], file: str) -> dict[str, Any]:
        """``{column: tensor}`` of the rows of ``pieces`` (at several ranks: this rank's, every
        ``world_size``-th row from ``rank`` on)."""
        out: dict[str, Any] = {}
        for field in self._schema:
            arrays = [p.column(field.name) for p in pieces]
            out[field.name] = _tensor(arrays, field.type)
            if self.world_size > 1:
                if isinstance(out[field.name], tuple):
                    raise ConfigError(
                        f"{self._path(file)}: column {field.name!r} holds lists, which a stream dealt out to "
                        f"{self.world_size} ranks does not split; leave it out with columns=[...]."
                    )
                out[field.name] = out[field.name][self.rank :: self.world_size].contiguous()
        return out


def _open_source(source: Any, filesystem: Any) -> tuple[Any, str, list[str] | None]:
    """(fsspec filesystem, the directory, or None with the list of files)."""
    import fsspec

    if isinstance(source, (list, tuple)):
        files = [os.fspath(f) for f in source]
        if not files:
            raise ConfigError("ParquetStream: the list of files is empty.")
        fs = filesystem if filesystem is not None else fsspec.core.url_to_fs(files[0])[0]
        return fs, "", [fs._strip_protocol(f) if filesystem is None else f for f in files]
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source: expected a directory (path or URL) or a list of files. Got {source!r}.")
    if filesystem is not None:
        return filesystem, os.fspath(source), None
    fs, root = fsspec.core.url_to_fs(os.fspath(source))
    return fs, root, None


def _selected(schema: Any, columns: list[str] | None, time_column: str | None, where: str) -> Any:
    """The schema of the columns a batch holds; ``ConfigError`` for a missing or unsupported one."""
    pa = _pyarrow()
    names = columns if columns is not None else list(schema.names)
    missing = [c for c in [*names, *([time_column] if time_column else [])] if c not in schema.names]
    if missing:
        raise ConfigError(f"{where}: no column {missing[0]!r}; its columns are {list(schema.names)}.")
    if time_column and time_column not in names:
        names = [*names, time_column]
    fields = [schema.field(c) for c in names]
    for f in fields:
        t = f.type
        ok = (
            pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_boolean(t)
            or pa.types.is_timestamp(t)
        )
        ok = ok or (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)
        if not ok:
            raise ConfigError(
                f"{where}: column {f.name!r} is {t}: a batch holds numbers, booleans, timestamps and lists of "
                "integers. Leave it out with columns=[...]."
            )
    return pa.schema(fields)


def _check_schema(schema: Any, want: Any, where: str) -> None:
    """``LogFileError`` naming the file when it lacks a column of ``want`` or has it with another type."""
    for field in want:
        if field.name not in schema.names:
            raise LogFileError(
                f"{where}: a foreign file: it has no column {field.name!r} (its columns: {list(schema.names)}); "
                "every file of the stream must have the first file's columns."
            )
        got = schema.field(field.name).type
        if got != field.type:
            raise LogFileError(
                f"{where}: a foreign file: column {field.name!r} is {got}, the stream's first file has {field.type}."
            )


def _concat_numpy(arrays: list[Any]) -> np.ndarray:
    parts = [a.to_numpy(zero_copy_only=False) for a in arrays]
    return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)


def _tensor(arrays: list[Any], type_: Any) -> Any:
    pa = _pyarrow()
    if pa.types.is_timestamp(type_):
        return torch.from_numpy(_concat_numpy([a.cast(pa.int64()) for a in arrays]))
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        chunk = pa.concat_arrays(arrays) if len(arrays) > 1 else arrays[0]
        offsets = np.asarray(chunk.offsets, dtype=np.int64)
        values = np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        return torch.from_numpy(values.copy()), torch.from_numpy(offsets[:-1] - offsets[0])
    return torch.from_numpy(_concat_numpy(arrays))
