"""Reading hierps arrays (their layout: :mod:`hierps.storage._arrays`): only the chunks that hold the rows
asked for, with plain file I/O.

A read plans, per array, the inner chunks holding the wanted rows, merges neighbouring ones into
runs (``_GAP_BYTES``), splits long runs (``_PIECE_BYTES``) and reads them with ``os.pread``: on the
calling thread when there are few, else on a shared pool of ``_THREADS`` threads, all arrays of a
request at once so that their I/O overlaps. Every chunk read is checked against its crc32c; a bad
or missing one is reported with its file name. :class:`OpenFiles` keeps descriptors open between
reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np

from hierps.errors import CorruptStoreError
from hierps.storage._arrays import Array, binding_tags
from hierps.storage._files import OpenFiles

__all__ = ["chunk_positions", "read_array", "read_arrays"]

# Chunks to read that lie closer than this are fetched by one read through the gap: on an SSD a
# read costs about as much as streaming ~50 KiB, so fewer, longer reads win below that.
_GAP_BYTES = 32 << 10
# Longer reads are split into pieces of about this size, read in parallel.
_PIECE_BYTES = 512 << 10
# Threads issuing reads: an SSD serves many outstanding random reads at once.
_THREADS = 16
_PARALLEL_RUNS = 4  # fewer runs are read by the calling thread
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


# -- reading ---------------------------------------------------------------------------------------
def read_array(
    arr: Array,
    root: Path,
    name: str,
    positions: np.ndarray | None = None,
    open_files: OpenFiles | None = None,
) -> np.ndarray:
    """All of ``arr`` (n, ...), or its rows at ``positions`` (k,) -> (k, ...); see :func:`read_arrays`.

    ``root`` and ``name`` are kept for the callers' symmetry with :func:`open_array`.
    """
    return next(read_arrays([(arr, positions)], open_files))


def read_arrays(
    requests: Sequence[tuple[Array, np.ndarray | None]], open_files: OpenFiles | None = None
) -> Iterator[np.ndarray]:
    """Rows of many arrays at once: for each ``(arr, positions)``, all of ``arr`` (n, ...) when
    ``positions`` is None, else its rows at ``positions`` (k,) int64 -> (k, ...), in request order.

    Only the chunks holding wanted rows are read, nearby ones in one read. The reads of every
    request are handed to the read threads at once, in request order (so reads of different arrays
    overlap on the device), and each result is checked (crc32c of its chunks) and decoded as it is
    taken from the iterator, while the reads of later requests go on. An error surfaces at the
    request it concerns: ``CorruptStoreError`` names a damaged, short or vanished file. Positions
    outside an array are refused before any read. Sorted positions (as every caller asks) need no sort.
    Files are opened through ``open_files`` when given (and stay open), else opened and closed here.
    """
    plans = [_plan(arr, positions) for arr, positions in requests]
    reader = _Reader(open_files)
    try:
        marks = [reader.start(plan.place(), inline=len(plans) == 1) for plan in plans]
        for plan, mark in zip(plans, marks):
            reader.wait(mark)
            yield plan.decode()
    finally:
        reader.close()


@dataclass(frozen=True, eq=False)
class _Run:
    """One pread: bytes from ``start`` of ``file`` (a file of ``arr``) into all of ``into``."""

    arr: Array
    file: Path
    start: int
    into: memoryview


@dataclass(eq=False)
class _Plan:
    """The chunks one request needs and, once placed, its buffer and where each chunk lies in it."""

    arr: Array
    pos: np.ndarray  # (k,) int64 rows wanted
    chunks: np.ndarray  # (c,) sorted chunk numbers holding them
    slot: np.ndarray  # (k,) index into ``chunks`` of each row's chunk
    span: bool = False  # ``pos`` is a range of consecutive rows: copied chunk by chunk, not row by row
    buf: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    at: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # (c,) offsets in buf

    @property
    def file_of(self) -> np.ndarray:
        return self.chunks // self.arr.chunks_per_file

    def place(self) -> list[_Run]:
        """Allocate the buffer and return the reads that fill it.

        Chunks are fetched in runs, one pread each: same file, in order, gaps below ``_GAP_BYTES``
        read through, at most about ``_PIECE_BYTES`` long (so that a long run is read in parallel).
        """
        arr, chunks, file_of = self.arr, self.chunks, self.file_of
        if len(chunks) == 0:
            return []
        start = arr.chunk_offsets(chunks)
        cut = np.ones(len(chunks), bool)
        cut[1:] = (file_of[1:] != file_of[:-1]) | (start[1:] - start[:-1] - arr.chunk_bytes > _GAP_BYTES)
        cut[1:] |= start[1:] < start[:-1]
        span = start - start[np.flatnonzero(cut)[np.cumsum(cut) - 1]]
        piece = span // _PIECE_BYTES
        cut[1:] |= piece[1:] != piece[:-1]
        run_first = np.flatnonzero(cut)
        run_of = np.cumsum(cut) - 1
        run_last = np.append(run_first[1:], len(chunks)) - 1
        run_start, run_end = start[run_first], start[run_last] + arr.chunk_bytes
        run_dest = np.concatenate([[0], np.cumsum(run_end - run_start)])
        self.buf = np.empty(int(run_dest[-1]), dtype=np.uint8)
        self.at = run_dest[run_of] + start - run_start[run_of]
        view = memoryview(self.buf.data)
        return [
            _Run(arr, arr.files[f], lo, view[dest : dest + hi - lo])
            for f, lo, hi, dest in zip(
                file_of[run_first].tolist(), run_start.tolist(), run_end.tolist(), run_dest.tolist()
            )
        ]

    def decode(self) -> np.ndarray:
        """Check this request's chunks (once read) and gather its rows: (k, ...) in native byte order."""
        arr, buf = self.arr, self.buf
        if len(self.pos) == 0:
            return np.empty((0, *arr.shape[1:]), dtype=arr.dtype.newbyteorder("="))
        _check_chunks(arr, buf, self.at, self.chunks)
        if self.span:
            return self._decode_span()
        rows = self.at[self.slot] + (self.pos - self.chunks[self.slot] * arr.chunk_rows) * arr.row_bytes
        # Every row as one opaque item starting at any byte of buf: a gather copies whole rows.
        items = np.ndarray((len(buf) - arr.row_bytes + 1,), np.dtype((np.void, arr.row_bytes)), buf, 0, (1,))
        out = items[rows].view(arr.dtype).reshape(len(self.pos), *arr.shape[1:])
        return out.astype(arr.dtype.newbyteorder("="), copy=False)

    def _decode_span(self) -> np.ndarray:
        """The rows of a range of consecutive rows: each chunk's payload (every chunk is written whole,
        the last one padded) copied as one item, then the range cut out of them."""
        arr, buf = self.arr, self.buf
        payload = arr.payload_bytes
        items = np.ndarray((len(buf) - payload + 1,), np.dtype((np.void, payload)), buf, 0, (1,))
        rows = items[self.at].view(arr.dtype).reshape(-1, *arr.shape[1:])
        skip = int(self.pos[0] - self.chunks[0] * arr.chunk_rows)
        return rows[skip : skip + len(self.pos)].astype(arr.dtype.newbyteorder("="), copy=False)


def chunk_positions(chunks: np.ndarray, chunk_rows: int, n: int) -> np.ndarray:
    """Sorted unique chunk numbers (c,) of an array of ``n`` rows in chunks of ``chunk_rows`` -> every
    row position in them (sorted)."""
    starts = np.asarray(chunks, np.int64) * chunk_rows
    counts = np.minimum(starts + chunk_rows, n) - starts
    if len(counts) == 0:
        return np.empty(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return np.arange(int(counts.sum()), dtype=np.int64) + offsets


def _plan(arr: Array, positions: np.ndarray | None) -> _Plan:
    """The chunks of ``arr`` holding ``positions`` (all rows when None); refuses rows outside it."""
    n = arr.shape[0]
    pos = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    if len(pos) == 0:
        return _Plan(arr, pos, np.empty(0, np.int64), np.empty(0, np.int64))
    if pos.min() < 0 or pos.max() >= n:
        raise CorruptStoreError(
            f"{arr.path}: rows {int(pos.min())}..{int(pos.max())} asked of an array of {n} rows; the key "
            "index does not match the segment. Open an earlier checkpoint or restore from a backup."
        )
    if pos[-1] - pos[0] == len(pos) - 1 and (len(pos) == 1 or np.all(pos[1:] > pos[:-1])):
        first, last = int(pos[0]) // arr.chunk_rows, int(pos[-1]) // arr.chunk_rows
        return _Plan(arr, pos, np.arange(first, last + 1, dtype=np.int64), np.empty(0, np.int64), span=True)
    chunk_of = pos // arr.chunk_rows
    if np.all(chunk_of[1:] >= chunk_of[:-1]):  # sorted: no sort needed
        new = np.flatnonzero(chunk_of[1:] != chunk_of[:-1]) + 1
        slot = np.zeros(len(pos), np.int64)
        slot[new] = 1
        return _Plan(arr, pos, chunk_of[np.append(0, new)], np.cumsum(slot))
    chunks, slot = np.unique(chunk_of, return_inverse=True)
    return _Plan(arr, pos, chunks, slot)


class _Reader:
    """Runs handed over request by request, read by the read threads in that order (or, for a lone
    request of few runs, at once by the calling thread); ``wait`` blocks until a request's are in."""

    def __init__(self, open_files: OpenFiles | None) -> None:
        self._files = open_files
        self._fds: dict[Path, int] = {}
        self._tasks: list[Future[None]] = []
        self._waited = 0

    def start(self, runs: list[_Run], inline: bool) -> int:
        """Start reading ``runs``; returns the mark to :meth:`wait` for before using their bytes."""
        for run in runs:
            if run.file not in self._fds:
                try:
                    if self._files is not None:
                        self._fds[run.file] = self._files.acquire(run.file)
                    else:
                        self._fds[run.file] = os.open(run.file, os.O_RDONLY)
                        os.posix_fadvise(self._fds[run.file], 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
                except OSError as exc:
                    raise _unreadable(run.arr, exc) from exc
        if inline and len(runs) < _PARALLEL_RUNS:
            self._read(runs)
            return len(self._tasks)
        # Tasks of a few runs each: enough tasks to keep every thread busy, few enough that
        # handing them over costs little next to the reads.
        per_task = max(1, len(runs) // (4 * _THREADS))
        pool = _executor()
        for first in range(0, len(runs), per_task):
            self._tasks.append(pool.submit(self._read, runs[first : first + per_task]))
        return len(self._tasks)

    def wait(self, mark: int) -> None:
        """Block until the tasks before ``mark`` are done; raise the first one's error, if any."""
        for task in self._tasks[self._waited : mark]:
            task.result()
        self._waited = max(self._waited, mark)

    def close(self) -> None:
        """Let every task finish (none may read a closed descriptor), then close (or release) the files."""
        futures_wait(self._tasks)
        for fd in self._fds.values():
            self._files.release(fd) if self._files is not None else os.close(fd)
        self._fds.clear()

    def _read(self, runs: list[_Run]) -> None:
        for run in runs:
            try:
                got = os.preadv(self._fds[run.file], [run.into], run.start)
            except OSError as exc:
                raise _unreadable(run.arr, exc) from exc
            if got != len(run.into):
                raise CorruptStoreError(
                    f"{run.file}: chunk could not be read (the file ends at {run.start + got} bytes, before "
                    f"{run.start + len(run.into)}); the array was truncated. Restore the store from a backup."
                )


def _unreadable(arr: Array, exc: OSError) -> CorruptStoreError:
    return CorruptStoreError(
        f"{arr.path}: a chunk file could not be read ({exc}); the array was damaged or deleted while "
        "in use. Restore the store from a backup, or open an earlier checkpoint."
    )


def _check_chunks(arr: Array, buf: np.ndarray, at: np.ndarray, chunks: np.ndarray) -> None:
    """Raise ``CorruptStoreError`` naming the file of the first chunk in ``buf`` whose crc32c fails, or
    that is not chunk ``chunks[i]`` of ``arr`` (its binding tag does not match)."""
    size = arr.payload_bytes
    view = memoryview(buf.data)
    words = np.lib.stride_tricks.as_strided(buf, (len(buf) - 3, 4), (1, 1))
    stored = words[at + size].view("<u4")[:, 0]
    check: Callable[[memoryview], int] = crc32c.crc32c
    actual = np.fromiter((check(view[a : a + size]) for a in at.tolist()), dtype=np.uint32, count=len(at))
    bad = np.flatnonzero(actual != stored)
    if len(bad):
        raise CorruptStoreError(
            f"{arr.files[int(chunks[bad[0]]) // arr.chunks_per_file]}: chunk failed its crc32c checksum "
            f"({len(bad)} chunk(s) of {arr.path}). Restore the store from a backup, or open an earlier checkpoint."
        )
    tags = words[at + size + 4].view("<u4")[:, 0]
    wrong = np.flatnonzero(binding_tags(chunks, actual, arr.seed) != tags)
    if len(wrong):
        raise CorruptStoreError(
            f"{arr.files[int(chunks[wrong[0]]) // arr.chunks_per_file]}: chunk {int(chunks[wrong[0]])} is "
            f"intact but is not the chunk of {arr.identity!r} at that position ({len(wrong)} chunk(s)): a file "
            "was copied over another, or chunks were moved. Restore the store from a backup, or open an "
            "earlier checkpoint."
        )


def _executor() -> ThreadPoolExecutor:
    """The process's read threads (made anew in a forked child, whose parent's threads are gone)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_THREADS, thread_name_prefix="hierps-read"))
        return _pool[1]
