"""A segment: one immutable sorted run of rows on disk, and what finds a key in it from RAM.

Layout of a segment directory (each a Zarr v3 array of :mod:`hierps.storage._arrays`)::

    rows     (n, 2 + width) float32, sorted by key: columns 0-1 hold the int64 key's bytes, the
             rest the row; inner chunks of ``chunk_rows`` rows (~4 KiB, at least 16 rows)
    fences   (c,) int64   the first key of each of the c inner chunks of ``rows``
    filter   (w,) uint64  a blocked Bloom filter of the keys (12 bits per key)

A key and its row share a chunk, so finding a stored key costs one chunk read: the filter says
whether the segment may hold the key (about 1% false positives), the fences which chunk, and the
chunk holds both the keys to compare and the row. What a segment keeps in RAM is its fences and
filter: ``8 / chunk_rows + 12 / 8`` bytes per key (1.8 for a dim-16 adagrad row, at most 2), loaded
on first use.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError
from hierps.rows._ids import sorted_unique
from hierps.storage._arrays import TRAILER, Array, ArrayWriter, make_dir, open_array
from hierps.storage._files import OpenFiles
from hierps.storage._filter import FILTER_BLOCK_CHUNKS, block_words, blocks_may_contain, bloom_build
from hierps.storage._reads import chunk_positions, read_array, read_arrays

__all__ = [
    "KEY_COLUMNS",
    "SEGMENT_DIRS",
    "Segment",
    "SegmentWriter",
    "bound_name",
    "chunk_rows_for",
    "segment_name",
    "stored_row_bytes",
]

KEY_COLUMNS = 2  # float32 columns holding a row's int64 key
# The directories of a segment under its own (what :class:`SegmentWriter`'s arrays make: the rows'
# 2-D chunk grid, the fences' and the filter's 1-D ones), which a writer may find made ahead.
SEGMENT_DIRS = ("rows/c/0", "fences/c", "filter/c")
_PAGE = (
    4 << 10
)  # inner chunks of at most a page (with their checksum and tag), page-aligned: a lookup reads one page
_MIN_CHUNK_ROWS = 16  # wide rows: chunks of 16 rows, so fences stay under 0.5 B per key
_SCAN_AHEAD = 2  # batches of a scan read ahead of the one it yields


def segment_name(table: str, seg: int) -> str:
    return f"{table}/{seg:08d}"


def array_identity(store_id: str, name: str, array: str) -> str:
    """What array ``array`` of segment ``name`` is, for the binding tags of its chunks: a copy of
    another segment's (of this store or another) fails them."""
    return f"{bound_name(store_id, name)}/{array}"


def bound_name(store_id: str, name: str) -> str:
    """What the chunks of segment ``name`` of store ``store_id`` are bound to (less the array): a
    segment another store adopts keeps it (``SegmentRef.origin``)."""
    return f"{store_id}:segments/{name}"


def stored_row_bytes(width: int) -> int:
    """Bytes a row of ``width`` floats takes in a segment's rows: its floats and its key's columns."""
    return 4 * (width + KEY_COLUMNS)


def chunk_rows_for(width: int) -> int:
    """Rows per inner chunk of a segment of rows of ``width`` floats (plus the key columns)."""
    return max(_MIN_CHUNK_ROWS, (_PAGE - TRAILER) // stored_row_bytes(width))


# -- writing ----------------------------------------------------------------------------------------
class SegmentWriter:
    """Writes one segment from runs of rows given in increasing key order, in bounded memory (a
    block of rows and one filter block at a time). Nothing is durable until the caller fsyncs the
    directory; a writer that fails leaves a partial directory that nothing names: the caller
    aborts it (:meth:`abort` closes its files) and removes it.
    """

    def __init__(
        self,
        zstore: LocalStore,
        root: Path,
        name: str,
        width: int,
        block_point: str | None = None,
        *,
        store_id: str,
        keep_index: bool = False,
        dirs_made: bool = False,
    ) -> None:
        self.name, self.width = name, width
        self._dirs_made = dirs_made  # its directories (SEGMENT_DIRS) are there already
        # With keep_index, the filter's words as written, for :meth:`index` (a small segment's: a
        # large one is written in bounded memory).
        self._kept: list[np.ndarray] | None = [] if keep_index else None
        self._index: tuple[np.ndarray, np.ndarray, int, Array | None] | None = None
        self._store_id = store_id
        self.chunk_rows = chunk_rows_for(width)
        if not dirs_made:
            make_dir(root / name)
        self._zstore = zstore
        self._rows = ArrayWriter(
            zstore,
            f"{name}/rows",
            (width + KEY_COLUMNS,),
            "float32",
            self.chunk_rows,
            block_point,
            align=_PAGE,
            identity=array_identity(store_id, name, "rows"),
            dirs_made=dirs_made,
        )
        self._filter = ArrayWriter(
            zstore,
            f"{name}/filter",
            (),
            "uint64",
            _PAGE // 8,
            identity=array_identity(store_id, name, "filter"),
            dirs_made=dirs_made,
        )
        self._block_rows = self.chunk_rows * FILTER_BLOCK_CHUNKS
        self._rows_buffer = np.empty((0, width + KEY_COLUMNS), np.float32)  # used again by each append
        self._block: list[np.ndarray] = []  # keys of the filter block being filled
        self._block_len = 0
        self._fences: list[np.ndarray] = []
        self._last: int | None = None
        self.first: int | None = None  # the first key appended
        self.n = 0

    def append(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """keys (k,) int64 sorted, all above the previous run's; rows (k, width) float32."""
        if len(keys) == 0:
            return
        if (self._last is not None and keys[0] <= self._last) or (
            len(keys) > 1 and np.any(keys[1:] <= keys[:-1])
        ):
            raise ValueError(f"segment {self.name}: keys must be appended in strictly increasing order")
        if len(self._rows_buffer) < len(keys):  # fresh pages once, not at every append
            self._rows_buffer = np.empty((len(keys), self.width + KEY_COLUMNS), np.float32)
        block = self._rows_buffer[: len(keys)]  # the rows writer copies what it keeps
        block[:, :KEY_COLUMNS] = (
            np.ascontiguousarray(keys, np.int64).view(np.float32).reshape(-1, KEY_COLUMNS)
        )
        block[:, KEY_COLUMNS:] = rows
        first = -self.n % self.chunk_rows  # the first row of this run that starts a chunk
        self._fences.append(keys[first :: self.chunk_rows].astype(np.int64))
        self._add_to_filter(keys)
        self._rows.append(block)
        if self.first is None:
            self.first = int(keys[0])
        self.n += len(keys)
        self._last = int(keys[-1])

    def _add_to_filter(self, keys: np.ndarray) -> None:
        while len(keys):
            take = min(len(keys), self._block_rows - self._block_len)
            self._block.append(keys[:take])
            self._block_len += take
            keys = keys[take:]
            if self._block_len == self._block_rows:
                self._write_block()

    def _write_block(self) -> None:
        keys = np.concatenate(self._block) if self._block else np.empty(0, np.int64)
        words = bloom_build(keys, block_words(len(keys), self.chunk_rows))
        self._filter.append(words)
        if self._kept is not None:
            self._kept.append(words)
        self._block, self._block_len = [], 0

    def abort(self) -> None:
        """Close every file of the segment left open by a failed :meth:`append` or :meth:`close`."""
        self._rows.abort()
        self._filter.abort()

    @property
    def key_range(self) -> tuple[int, int] | None:
        """The first and last keys appended (None before any)."""
        return None if self.first is None or self._last is None else (self.first, self._last)

    def close(self) -> tuple[int, int]:
        """Finish the segment's arrays; returns its row count and :func:`fences_check`."""
        self._rows_buffer = self._rows_buffer[:0].copy()
        self._rows.close()
        fault_point("ssd.segment_rows_written")
        if self._block_len or self.n == 0:
            self._write_block()
        self._filter.close()
        fences = np.concatenate(self._fences) if self._fences else np.empty(0, np.int64)
        out = ArrayWriter(
            self._zstore,
            f"{self.name}/fences",
            (),
            "int64",
            max(1, len(fences)),
            identity=array_identity(self._store_id, self.name, "fences"),
            dirs_made=self._dirs_made,
        )
        out.append(fences)
        out.close()
        if self._kept is not None and self._last is not None:
            self._index = (fences, np.concatenate(self._kept), self._last, self._rows.written())
        return self.n, fences_check(fences)

    @property
    def index(self) -> tuple[np.ndarray, np.ndarray, int, Array | None] | None:
        """Once closed, with ``keep_index`` and rows: the fences and filter words written, the last
        key and the rows' array as opened (what :meth:`Segment.preload` takes), else None."""
        return self._index


def fences_check(fences: np.ndarray) -> int:
    """What identifies a segment's content in a manifest: the CRC-32 of its fences (its keys, sampled).

    A segment copied over another (whose checksums all pass) is caught by it."""
    return zlib.crc32(np.ascontiguousarray(fences, "<i8").tobytes())


# -- reading ----------------------------------------------------------------------------------------
@dataclass(eq=False)
class Segment:
    """One segment of a table, opened lazily: nothing is read before the first lookup or scan."""

    root: Path
    zstore: LocalStore
    table: str
    seg: int
    n: int  # rows, as the manifest records them
    width: int
    files: OpenFiles
    check: int  # fences_check of its content, as the manifest records it
    store_id: str  # the store's id (its marker's uid): the chunks' binding tags name it
    # Adopted from another store: what its chunks' binding tags name (that store's id and the
    # segment's name there, as SegmentRef.origin); None: this store's id and this name.
    origin: str | None = None
    _rows: Array | None = field(default=None, init=False)
    _fences: np.ndarray | None = field(default=None, init=False)
    _filter: np.ndarray | None = field(default=None, init=False)
    _last: int = field(default=0, init=False)  # its largest key (valid once loaded)
    _range: tuple[int, int] | None = field(default=None, init=False)  # its first and last keys, once known

    @property
    def name(self) -> str:
        return segment_name(self.table, self.seg)

    @property
    def path(self) -> Path:
        return self.root / self.name

    @property
    def bound_to(self) -> str:
        """What the binding tags of its chunks name, less the array: ``SegmentRef.origin``'s form."""
        return self.origin if self.origin is not None else bound_name(self.store_id, self.name)

    def _identity(self, array: str) -> str:
        return f"{self.bound_to}/{array}"

    @property
    def ram_bytes(self) -> int:
        """Bytes this segment holds in RAM (its fences and filter, once loaded)."""
        return sum(a.nbytes for a in (self._fences, self._filter) if a is not None)

    @property
    def rows_array(self) -> Array:
        if self._rows is None:
            arr = open_array(
                self.zstore,
                self.root,
                f"{self.name}/rows",
                "float32",
                2,
                self.files,
                identity=self._identity("rows"),
            )
            if arr.shape != (self.n, self.width + KEY_COLUMNS):
                raise CorruptStoreError(
                    f"{self.path}: rows of shape {arr.shape} do not form the segment the manifest names "
                    f"({self.n} rows of table {self.table!r}, width {self.width}). The segment or the "
                    "manifest is damaged."
                )
            self._rows = arr
        return self._rows

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self._fences is None or self._filter is None:
            arrays = {}
            for name, dtype in (("fences", "int64"), ("filter", "uint64")):
                arr = open_array(
                    self.zstore,
                    self.root,
                    f"{self.name}/{name}",
                    dtype,
                    1,
                    self.files,
                    identity=self._identity(name),
                )
                arrays[name] = read_array(arr, self.root, f"{self.name}/{name}", open_files=self.files)
            rows = self.rows_array
            fences, filt = arrays["fences"], arrays["filter"]
            if (
                len(fences) != math.ceil(self.n / rows.chunk_rows)
                or (len(fences) > 1 and not np.all(fences[1:] > fences[:-1]))
                or fences_check(fences) != self.check
            ):
                raise CorruptStoreError(
                    f"{self.path}: its keys (fences) do not form the segment the manifest names ({self.n} rows, "
                    f"check {self.check}); the segment is damaged or another segment was copied over it. "
                    "Restore the store from a backup or open an earlier checkpoint."
                )
            blocks = -(-len(fences) // FILTER_BLOCK_CHUNKS)
            full = block_words(rows.chunk_rows * FILTER_BLOCK_CHUNKS, rows.chunk_rows)
            tail = self.n - (blocks - 1) * rows.chunk_rows * FILTER_BLOCK_CHUNKS if blocks else 0
            if len(filt) != max(0, blocks - 1) * full + block_words(tail, rows.chunk_rows):
                raise CorruptStoreError(
                    f"{self.path}: its key filter has {len(filt)} words, not what its {self.n} rows make; "
                    "the segment is damaged. Restore the store from a backup or open an earlier checkpoint."
                )
            last = int(
                split_block(
                    read_array(rows, self.root, f"{self.name}/rows", np.array([self.n - 1]), self.files)
                )[0][0]
            )
            if last < fences[-1]:
                raise CorruptStoreError(
                    f"{self.path}: its last key {last} is below its last chunk's first key {fences[-1]}; the "
                    "segment is damaged. Restore the store from a backup or open an earlier checkpoint."
                )
            self._fences, self._filter, self._last = fences, filt, last
            self._range = (int(fences[0]), last)
        return self._fences, self._filter

    def key_range(self) -> tuple[int, int] | None:
        """Its first and last keys (None when it holds no row): known once written or loaded, else
        read from its first and last rows (two chunks, checked; nothing else is loaded)."""
        if self.n == 0:
            return None
        if self._range is None:
            if self._fences is not None:
                self._range = (int(self._fences[0]), self._last)
            else:
                ends = np.array(sorted({0, self.n - 1}), np.int64)
                keys = split_block(
                    read_array(self.rows_array, self.root, f"{self.name}/rows", ends, self.files)
                )[0]
                self._range = (int(keys[0]), int(keys[-1]))
        return self._range

    @property
    def span(self) -> tuple[int, int] | None:
        """Its first and last keys where known (written, loaded or read: :meth:`key_range`), else None:
        nothing is read."""
        return self._range

    def known_range(self, first: int, last: int) -> None:
        """Record its first and last keys, as its writer saw them."""
        self._range = (first, last)

    def preload(self, fences: np.ndarray, filt: np.ndarray, last: int, rows: Array | None) -> None:
        """Hold the fences, filter words, last key and rows' array its writer just wrote
        (:attr:`SegmentWriter.index`) instead of reading them back at the first lookup."""
        self._fences, self._filter, self._last = fences, filt, last
        if rows is not None and rows.shape == (self.n, self.width + KEY_COLUMNS):
            self._rows = rows
        self._range = (int(fences[0]), last)

    def unload(self) -> None:
        """Drop the fences and filter from RAM (they load again on the next lookup)."""
        self._fences = self._filter = None

    def candidates(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 sorted -> (positions (m,) int64 ascending of those that may be here, the
        chunks to read for them (c,) int64 sorted unique). Keys outside the segment's first and last
        key are ruled out by two searches of ``keys``; where there are at least as many keys left as
        chunks in their range, every chunk of it is read (nearly every one holds a key, and the reads
        are long sequential runs), found by two searches of the fences."""
        none = np.empty(0, np.int64)
        if self.n == 0 or len(keys) == 0:
            return none, none
        span = self._range  # known (written, loaded or read): a segment the keys miss loads nothing
        if span is not None and (keys[-1] < span[0] or keys[0] > span[1]):
            return none, none
        fences, filt = self._load()
        if keys[0] >= fences[0] and keys[-1] <= self._last:  # all within (a lookup's keys of its range)
            lo, hi = 0, len(keys)
        else:
            lo = int(np.searchsorted(keys, fences[0]))
            hi = int(np.searchsorted(keys, self._last, side="right"))
            if lo >= hi:
                return none, none
        # The chunks of the first and last key (two searches, not one a key) decide it.
        first = int(np.searchsorted(fences, keys[lo], side="right")) - 1
        last = int(np.searchsorted(fences, keys[hi - 1], side="right")) - 1
        if hi - lo >= last - first + 1:
            return np.arange(lo, hi, dtype=np.int64), np.arange(first, last + 1, dtype=np.int64)
        chunk = np.searchsorted(fences, keys[lo:hi], side="right") - 1
        # Fewer keys than chunks in their range: the filter saves reads.
        full = block_words(self.rows_array.chunk_rows * FILTER_BLOCK_CHUNKS, self.rows_array.chunk_rows)
        maybe = blocks_may_contain(filt, keys[lo:hi], chunk // FILTER_BLOCK_CHUNKS, full)
        return lo + np.flatnonzero(maybe), sorted_unique(chunk[maybe].astype(np.int64, copy=False))

    def chunk_positions(self, chunks: np.ndarray) -> np.ndarray:
        """Sorted unique chunk indices (c,) -> every row position in them (sorted)."""
        return chunk_positions(chunks, self.rows_array.chunk_rows, self.n)

    def scan(self, batch_rows: int) -> Generator[tuple[np.ndarray, np.ndarray], None, None]:
        """Yield ``(keys (b,) int64, rows (b, width) float32)`` of every row, in key order."""
        arr = self.rows_array
        step = max(arr.chunk_rows, batch_rows - batch_rows % arr.chunk_rows)
        # The next batches are read on the read threads while this one is merged (one lazy read,
        # _SCAN_AHEAD batches in flight at most): a scan waits for the device only when it outruns it.
        batches = ((arr, np.arange(start, min(start + step, self.n))) for start in range(0, self.n, step))
        ahead = _SCAN_AHEAD * -(-step // arr.chunk_rows) * arr.chunk_bytes
        blocks = read_arrays(batches, self.files, ahead_bytes=ahead)
        try:
            for block in blocks:
                yield split_block(block)
        finally:
            blocks.close()  # a scan closed early lets its reads finish and releases its files now


def split_block(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k, 2 + width) float32 rows of a segment -> (keys (k,) int64, rows (k, width) float32)."""
    if block.flags.c_contiguous and block.dtype == np.float32:
        # Each key as one 8-byte item a row apart: copied six times faster than as two float32 columns.
        keys = np.ndarray((len(block),), np.int64, block, 0, (block.strides[0],)).copy()
    else:
        keys = np.ascontiguousarray(block[:, :KEY_COLUMNS]).view(np.int64).reshape(-1)
    return keys, block[:, KEY_COLUMNS:]
