"""Reading hierps arrays (their layout: :mod:`hierps.storage._arrays`): only the chunks that hold the rows
asked for, with plain file I/O.

A read plans, per array, the inner chunks holding the wanted rows, merges neighbouring ones into
runs (``_GAP_BYTES``), splits long runs (``_PIECE_BYTES``) and reads them with ``os.pread``: on the
calling thread when there are few, else on a shared pool of ``_THREADS`` threads, all arrays of a
request at once so that their I/O overlaps. Every chunk read is checked against its crc32c and its
binding tag; a bad or missing one is reported with its file name. :class:`OpenFiles` keeps
descriptors open between reads.

With the compiled core (:mod:`hierps.storage._native`) each read thread checks the chunks it has
just read and copies the wanted rows out of them in one pass, without the GIL, while they are in
its cache: the check and the gather run on every core, beside the reads. Without it, the calling
thread checks and gathers each request's buffer with numpy (:meth:`_Plan.decode`), the reference
the compiled path is tested against.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from hierps.errors import CorruptStoreError
from hierps.storage import _native
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
# A request of at most this many bytes is first read by the calling thread from what the page cache
# holds (RWF_NOWAIT; compiled core): a read from memory costs less than handing it to a read thread
# (tens of microseconds and a wake-up each), and only the runs not all in memory go to the threads.
_CACHED_BYTES = 4 << 20
# A read task's bytes at most (unless one run is longer).
_TASK_BYTES = 4 << 20
# A read thread keeps a buffer of up to this many bytes for the next run it reads (a run is at most
# _PIECE_BYTES and a chunk); a run longer than this (of an array of huge chunks) gets one of its own.
_SCRATCH_BYTES = 1 << 20
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
    requests: Iterable[tuple[Array, np.ndarray | None]],
    open_files: OpenFiles | None = None,
    ahead_bytes: int | None = None,
) -> Generator[np.ndarray, None, None]:
    """Rows of many arrays at once: for each ``(arr, positions)``, all of ``arr`` (n, ...) when
    ``positions`` is None, else its rows at ``positions`` (k,) int64 -> (k, ...), in request order.

    Only the chunks holding wanted rows are read, nearby ones in one read. A request of up to
    ``_CACHED_BYTES`` is first read by the calling thread as far as the page cache holds it whole
    (compiled core). The reads of every request (the rest of them) are handed to the read threads
    at once, in request order (so reads of different arrays overlap on the device), and each result
    is checked (crc32c and binding tag of its chunks) and gathered by the read threads as its reads
    come in (compiled core), or as it is taken from the iterator (numpy), while the reads of later
    requests go on. An error surfaces at the
    request it concerns: ``CorruptStoreError`` names a damaged, short or vanished file. Positions
    outside an array are refused before any read. Sorted positions (as every caller asks) need no sort.
    Files are opened through ``open_files`` when given (and stay open), else opened and closed here.

    With ``ahead_bytes``, ``requests`` is taken lazily (it may be a generator): requests are planned
    and their reads started while the chunks of those started and not yet taken from the iterator
    come to less than ``ahead_bytes``, so that memory stays bounded however many there are, and the
    reads of the next requests go on while the caller works on this one. Positions outside an array
    are then refused before that request's reads.
    """
    if ahead_bytes is None:  # every request planned (and checked) before any read; all in flight
        planned = [_plan(arr, positions) for arr, positions in requests]
        plans, inline, ahead = iter(planned), len(planned) == 1, float("inf")
    else:
        plans, inline, ahead = (_plan(arr, positions) for arr, positions in requests), False, ahead_bytes
    started: deque[tuple[_Plan, int, int]] = deque()  # (plan, mark, its chunks' bytes)
    reader, held, more = _Reader(open_files), 0, True
    try:
        while True:
            while more and (not started or held < ahead):
                plan = next(plans, None)
                if plan is None:
                    more = False
                    break
                size = len(plan.chunks) * plan.arr.chunk_bytes
                started.append((plan, reader.start(plan, inline=inline), size))
                held += size
            if not started:
                return
            plan, mark, size = started.popleft()
            reader.wait(mark)
            held -= size
            yield plan.decode()
    finally:
        reader.close()


# A plan's arrays before it is placed (read-only: shared by every plan).
_NO_INT64: np.ndarray = np.empty(0, np.int64)
_ONE_ZERO: np.ndarray = np.zeros(1, np.int64)
_NO_BYTES: np.ndarray = np.empty(0, np.uint8)
for _shared in (_NO_INT64, _ONE_ZERO, _NO_BYTES):
    _shared.flags.writeable = False


@dataclass(eq=False)
class _Plan:
    """The chunks one request needs and, once placed, the reads that fetch them and where each chunk
    lies in the request's buffer: ``at``, run ``i`` filling bytes ``run_dest[i]:run_dest[i + 1]`` of it."""

    arr: Array
    pos: np.ndarray  # (k,) int64 rows wanted
    chunks: np.ndarray  # (c,) sorted chunk numbers holding them
    slot: np.ndarray  # (k,) index into ``chunks`` of each row's chunk (compiled, rows in chunk order: unused)
    span: bool = False  # ``pos`` is a range of consecutive rows: copied chunk by chunk, not row by row
    ordered: bool = True  # rows come in chunk order (``slot`` nondecreasing)
    # Where chunk i lies in the request's buffer (c,); run j: (r,) its file (an index into
    # arr.files), its offset there; (r + 1,) its offset in the buffer, its first chunk.
    # (Until placed: shared read-only arrays of no run, made once: a plan is made per request.)
    at: np.ndarray = field(default_factory=lambda: _NO_INT64)
    run_file: np.ndarray = field(default_factory=lambda: _NO_INT64)
    run_start: np.ndarray = field(default_factory=lambda: _NO_INT64)
    run_dest: np.ndarray = field(default_factory=lambda: _ONE_ZERO)
    run_chunk: np.ndarray = field(default_factory=lambda: _ONE_ZERO)
    # The numpy path: the whole request's buffer, checked and gathered by :meth:`decode`.
    buf: np.ndarray = field(default_factory=lambda: _NO_BYTES)
    # The compiled path (rows in chunk order): each read task checks its runs' chunks and copies their
    # rows (``run_row[i]:run_row[i + 1]`` for run i) into ``out``, keeping what it found in ``checks``
    # (by its first run: the first chunk whose crc32c fails, their count, the same for binding tags).
    fused: bool = False
    out: np.ndarray = field(default_factory=lambda: _NO_BYTES)
    run_row: np.ndarray = field(default_factory=lambda: _ONE_ZERO)
    checks: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)  # first run -> check_gather's

    @property
    def file_of(self) -> np.ndarray:
        return self.chunks // self.arr.chunks_per_file

    @property
    def n_runs(self) -> int:
        return len(self.run_start)

    def place(self) -> None:
        """Plan the reads: chunks are fetched in runs, one pread each: same file, in order, gaps below
        ``_GAP_BYTES`` read through, at most about ``_PIECE_BYTES`` long (so that a long run is read
        in parallel). The numpy path allocates the request's buffer, the compiled one its output."""
        arr, chunks, file_of = self.arr, self.chunks, self.file_of
        if len(chunks) == 0:
            return
        start = arr.chunk_offsets(chunks)
        if _native.enabled():
            self._place_compiled(start, file_of)
            return
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
        self.run_dest = np.concatenate([[0], np.cumsum(run_end - run_start)])
        self.at = self.run_dest[run_of] + start - run_start[run_of]
        self.run_file, self.run_start = file_of[run_first], run_start
        self.run_chunk = np.append(run_first, len(chunks))
        self.buf = np.empty(int(self.run_dest[-1]), dtype=np.uint8)

    def _place_compiled(self, start: np.ndarray, file_of: np.ndarray) -> None:
        """:meth:`place` by the compiled core: the same runs, cut in one loop. Rows in chunk order are
        read fused (each run's rows follow those of the run before); others are gathered by
        :meth:`decode`, from the request's buffer."""
        arr, c = self.arr, len(self.chunks)
        # One allocation cut in six: (c,) each for the chunks and the runs' files and offsets, (c + 1,)
        # each for the runs' first chunks, offsets in the buffer and first rows.
        at, run_file, run_start, run_chunk, run_dest, run_row = np.split(
            np.empty(6 * c + 3, np.int64), np.cumsum([c, c, c, c + 1, c + 1])
        )
        ordered = self.ordered
        r = _native.plan_runs(
            np.ascontiguousarray(start, np.int64), np.ascontiguousarray(file_of, np.int64), arr.chunk_bytes,
            _GAP_BYTES, _PIECE_BYTES, at, run_chunk, run_file, run_start, run_dest,
            self.pos if ordered else None, self.chunks if ordered else None, arr.chunk_rows,
            run_row if ordered else None,
        )  # fmt: skip
        self.at, self.run_chunk, self.run_file = at, run_chunk[: r + 1], run_file[:r]
        self.run_start, self.run_dest = run_start[:r], run_dest[: r + 1]
        if ordered:
            self.fused, self.run_row = True, run_row[: r + 1]
            self.out = np.empty((len(self.pos), *arr.shape[1:]), arr.dtype)
        else:
            self.buf = np.empty(int(self.run_dest[-1]), dtype=np.uint8)

    def tasks(self, threads: int = _THREADS, start: int = 0) -> list[tuple[int, int]]:
        """The runs from ``start`` on cut into tasks ``(first, stop)`` for ``threads`` of the read threads.

        Compiled: a share of the bytes each, at most ``_TASK_BYTES`` unless a run is longer. Each task
        reads its runs in turn without the GIL, so ``threads`` tasks keep as many reads in flight; more
        would only cost their handing over (tens of microseconds each, and the GIL taken back from the
        caller). numpy: a quarter of a thread's share of the runs each, their reads in a Python loop
        (as before the compiled core).
        """
        if not self.fused:
            per_task = max(1, (self.n_runs - start) // (4 * _THREADS))
            return [
                (first, min(first + per_task, self.n_runs)) for first in range(start, self.n_runs, per_task)
            ]
        dest = self.run_dest[start:] - self.run_dest[start]
        target = max(1, min(_TASK_BYTES, -(-int(dest[-1]) // threads)))
        group = (dest[1:] - 1) // target
        cuts = (np.flatnonzero(group[1:] != group[:-1]) + 1 + start).tolist()
        return list(zip([start, *cuts], [*cuts, self.n_runs]))

    def read_fused(self, fds: np.ndarray, first: int, stop: int, cached: bool = False) -> int:
        """The compiled path, on a read thread: read runs ``first:stop`` one by one into this thread's
        scratch buffer, each checked and its rows copied to ``out`` right after its read, while its
        bytes are in the cache; one call without the GIL. Returns ``stop``. With ``cached`` (on the
        calling thread), only while the page cache holds the runs whole: returns the first run not
        read (the runs before it checked and gathered)."""
        arr = self.arr
        total = int(self.run_dest[stop] - self.run_dest[first])  # the longest run is no longer
        scratch = _scratch(
            total if total <= _SCRATCH_BYTES else int(np.diff(self.run_dest[first : stop + 1]).max())
        )
        failed, got, *found = _native.read_check_gather(
            fds, self.run_start, self.run_dest, self.run_chunk, self.run_row, first, stop, scratch, self.at,
            self.chunks, self.pos, arr.payload_bytes, arr.seed, arr.chunk_rows, arr.row_bytes, self.out, cached,
        )  # fmt: skip
        if cached and failed >= 0 and got == -errno.EAGAIN:  # not all in memory: the runs before it are read
            if failed > first:
                self.checks[first] = (found[0], found[1], found[2], found[3])
            return failed
        if failed >= 0:
            if got < 0:
                raise _unreadable(arr, OSError(-got, os.strerror(-got)))
            length = int(self.run_dest[failed + 1] - self.run_dest[failed])
            raise _short_read(arr.files[int(self.run_file[failed])], int(self.run_start[failed]), got, length)
        self.checks[first] = (found[0], found[1], found[2], found[3])
        return stop

    def read(self, fds: list[int], first: int, stop: int) -> None:
        """The numpy path: read runs ``first:stop`` into the request's buffer."""
        view = memoryview(self.buf.data)
        dest = self.run_dest[first : stop + 1].tolist()
        for i, fd, start in zip(range(first, stop), fds[first:stop], self.run_start[first:stop].tolist()):
            into = view[dest[i - first] : dest[i - first + 1]]
            try:
                got = os.preadv(fd, [into], start)
            except OSError as exc:
                raise _unreadable(self.arr, exc) from exc
            if got != len(into):
                raise _short_read(self.arr.files[int(self.run_file[i])], start, got, len(into))

    def decode(self) -> np.ndarray:
        """Check this request's chunks (once read) and gather its rows: (k, ...) in native byte order."""
        arr, buf = self.arr, self.buf
        if len(self.pos) == 0:
            return np.empty((0, *arr.shape[1:]), dtype=arr.dtype.newbyteorder("="))
        if self.fused:
            self._raise_bad(self.checks.values())
            return self.out.astype(arr.dtype.newbyteorder("="), copy=False)
        if _native.enabled():  # rows out of chunk order: checked and gathered here, by their slots
            out = np.empty((len(self.pos), *arr.shape[1:]), arr.dtype)
            found = _native.check_gather(
                buf, self.at, self.chunks, arr.payload_bytes, arr.seed, self.pos, arr.chunk_rows,
                arr.row_bytes, out.reshape(len(self.pos), -1).view(np.uint8), self.slot,
            )  # fmt: skip
            self._raise_bad([found])
            return out.astype(arr.dtype.newbyteorder("="), copy=False)
        _check_chunks(arr, buf, self.at, self.chunks)
        if self.span:
            return self._decode_span()
        rows = self.at[self.slot] + (self.pos - self.chunks[self.slot] * arr.chunk_rows) * arr.row_bytes
        # Every row as one opaque item starting at any byte of buf: a gather copies whole rows.
        items = np.ndarray((len(buf) - arr.row_bytes + 1,), np.dtype((np.void, arr.row_bytes)), buf, 0, (1,))
        out = items[rows].view(arr.dtype).reshape(len(self.pos), *arr.shape[1:])
        return out.astype(arr.dtype.newbyteorder("="), copy=False)

    def _raise_bad(self, checks: Iterable[tuple[int, int, int, int]]) -> None:
        """Raise what :func:`_check_chunks` raises, from compiled checks (the first chunk whose crc32c
        fails, their count, the first whose binding tag fails, their count)."""
        n_crc = sum(found[1] for found in checks)
        if n_crc:
            bad = min(found[0] for found in checks if found[1])
            raise _crc_error(self.arr, int(self.chunks[bad]), n_crc)
        n_tag = sum(found[3] for found in checks)
        if n_tag:
            wrong = min(found[2] for found in checks if found[3])
            raise _tag_error(self.arr, int(self.chunks[wrong]), n_tag)

    def _decode_span(self) -> np.ndarray:
        """The rows of a range of consecutive rows: each chunk's payload (every chunk is written whole,
        the last one padded) copied as one item, then the range cut out of them."""
        arr, buf = self.arr, self.buf
        payload = arr.payload_bytes
        items = np.ndarray((len(buf) - payload + 1,), np.dtype((np.void, payload)), buf, 0, (1,))
        rows = items[self.at].view(arr.dtype).reshape(-1, *arr.shape[1:])
        skip = int(self.pos[0] - self.chunks[0] * arr.chunk_rows)
        return rows[skip : skip + len(self.pos)].astype(arr.dtype.newbyteorder("="), copy=False)


_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's read buffer, of at least ``size`` bytes: kept between reads (no page faults, in
    the cache), or, past ``_SCRATCH_BYTES``, one for this read alone."""
    if size > _SCRATCH_BYTES:
        return np.empty(size, np.uint8)
    buf: np.ndarray | None = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = np.empty(_SCRATCH_BYTES, np.uint8)
    return buf


def chunk_positions(chunks: np.ndarray, chunk_rows: int, n: int) -> np.ndarray:
    """Sorted unique chunk numbers (c,) of an array of ``n`` rows in chunks of ``chunk_rows`` -> every
    row position in them (sorted)."""
    if len(chunks) and chunks[-1] - chunks[0] == len(chunks) - 1:  # a run of chunks: its rows in one range
        return np.arange(
            int(chunks[0]) * chunk_rows, min((int(chunks[-1]) + 1) * chunk_rows, n), dtype=np.int64
        )
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
    if _native.enabled():  # the same checks and chunks in one loop (rows out of chunk order: below)
        pos = np.ascontiguousarray(pos)
        chunks = np.empty(len(pos), np.int64)
        c, kind, lo, hi = _native.plan_chunks(pos, arr.chunk_rows, n, chunks)
        if kind == 0:
            raise _outside(arr, lo, hi)
        if kind in (1, 2):
            return _Plan(arr, pos, chunks[:c], np.empty(0, np.int64), span=kind == 1)
    if pos.min() < 0 or pos.max() >= n:
        raise _outside(arr, int(pos.min()), int(pos.max()))
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
    return _Plan(arr, pos, chunks, slot, ordered=False)


def _outside(arr: Array, lo: int, hi: int) -> CorruptStoreError:
    return CorruptStoreError(
        f"{arr.path}: rows {lo}..{hi} asked of an array of {arr.shape[0]} rows; the key index does not "
        "match the segment. Open an earlier checkpoint or restore from a backup."
    )


class _Reader:
    """Runs handed over request by request, read by the read threads in that order (or, for a lone
    request of few runs, at once by the calling thread; for a small one, by the calling thread as far
    as the page cache holds it); ``wait`` blocks until a request's are in."""

    def __init__(self, open_files: OpenFiles | None) -> None:
        self._files = open_files
        # Requests up to this size are first read from the page cache, until one finds its first run
        # missing there (the reads of a cold store: the rest go straight to the threads).
        self._cached_bytes = _CACHED_BYTES
        self._fds: dict[Path, int] = {}
        self._tasks: list[Future[None]] = []
        self._waited = 0
        self._busy = 0  # tasks handed to the read threads and not finished
        self._busy_lock = threading.Lock()

    def start(self, plan: _Plan, inline: bool) -> int:
        """Start reading the runs of ``plan``; returns the mark to :meth:`wait` for before decoding it."""
        plan.place()
        arr = plan.arr
        if len(arr.files) == 1:
            fds = np.full(plan.n_runs, self._open(arr, arr.files[0]) if plan.n_runs else -1, np.int64)
        else:
            files, which = np.unique(plan.run_file, return_inverse=True)
            fds = np.array([self._open(arr, arr.files[f]) for f in files.tolist()], np.int64)[which]
        read: Callable[[int, int], object] = (
            partial(plan.read_fused, fds) if plan.fused else partial(plan.read, fds.tolist())
        )
        if inline and plan.n_runs < _PARALLEL_RUNS:
            if plan.n_runs:
                read(0, plan.n_runs)
            return len(self._tasks)
        done = 0
        if plan.fused and plan.n_runs and plan.run_dest[-1] <= self._cached_bytes:
            done = plan.read_fused(fds, 0, plan.n_runs, cached=True)
            if done == plan.n_runs:
                return len(self._tasks)
            if done == 0:
                self._cached_bytes = 0
        # Spread over the threads that the tasks already handed over leave idle (one at least): with
        # many small requests in flight (a lookup over many segments) each is one task, not _THREADS,
        # and as many reads stay in flight.
        tasks = plan.tasks(max(1, _THREADS - self._busy), start=done)
        with self._busy_lock:
            self._busy += len(tasks)
        pool = _executor()
        self._tasks.extend(pool.submit(self._run, read, first, stop) for first, stop in tasks)
        return len(self._tasks)

    def _run(self, read: Callable[[int, int], object], first: int, stop: int) -> None:
        """A task on a read thread: runs ``first:stop`` read, counted done however it ends."""
        try:
            read(first, stop)
        finally:
            with self._busy_lock:
                self._busy -= 1

    def _open(self, arr: Array, file: Path) -> int:
        if file not in self._fds:
            try:
                if self._files is not None:
                    self._fds[file] = self._files.acquire(file)
                else:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                    os.posix_fadvise(self._fds[file], 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
            except OSError as exc:
                raise _unreadable(arr, exc) from exc
        return self._fds[file]

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


def _short_read(file: Path, start: int, got: int, length: int) -> CorruptStoreError:
    return CorruptStoreError(
        f"{file}: chunk could not be read (the file ends at {start + got} bytes, before "
        f"{start + length}); the array was truncated. Restore the store from a backup."
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
    check: Callable[[memoryview], int] = _native.crc32c
    actual = np.fromiter((check(view[a : a + size]) for a in at.tolist()), dtype=np.uint32, count=len(at))
    bad = np.flatnonzero(actual != stored)
    if len(bad):
        raise _crc_error(arr, int(chunks[bad[0]]), len(bad))
    tags = words[at + size + 4].view("<u4")[:, 0]
    wrong = np.flatnonzero(binding_tags(chunks, actual, arr.seed) != tags)
    if len(wrong):
        raise _tag_error(arr, int(chunks[wrong[0]]), len(wrong))


def _crc_error(arr: Array, chunk: int, count: int) -> CorruptStoreError:
    """The error of ``count`` chunks of ``arr`` whose crc32c fails, the first being ``chunk``."""
    return CorruptStoreError(
        f"{arr.files[chunk // arr.chunks_per_file]}: chunk failed its crc32c checksum ({count} chunk(s) of "
        f"{arr.path}). Restore the store from a backup, or open an earlier checkpoint."
    )


def _tag_error(arr: Array, chunk: int, count: int) -> CorruptStoreError:
    """The error of ``count`` intact chunks of ``arr`` that are not the chunk at their place, the first ``chunk``."""
    return CorruptStoreError(
        f"{arr.files[chunk // arr.chunks_per_file]}: chunk {chunk} is intact but is not the chunk of "
        f"{arr.identity!r} at that position ({count} chunk(s)): a file was copied over another, or chunks "
        "were moved. Restore the store from a backup, or open an earlier checkpoint."
    )


def _reset_pool_in_child() -> None:
    """In a forked child: the parent's read threads are gone, and another of its threads may have
    held ``_pool_lock`` at the fork; start over with a fresh lock and no pool."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_pool_in_child)


def _executor() -> ThreadPoolExecutor:
    """The process's read threads (made anew in a forked child, whose parent's threads are gone)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_THREADS, thread_name_prefix="hierps-read"))
        return _pool[1]
