"""SSD tier: every row that is not newer in a tier above, as an LSM tree of immutable segments.

Layout under ``<store>/segments``: one directory per segment, ``<table>/<segment id, 8 digits>``,
a sorted run of rows with its own fences and key filter (:mod:`hierps.storage._segment`). A key
may lie in several segments; the one with the highest id holds its newest row. RAM holds no
per-key index, only each segment's fences and filter (under 2 bytes per key, loaded on first
use) and a count of its live rows (those that are the newest of their key).

- A write (a batch of rows leaving the RAM tier) becomes one new segment. The keys it supersedes
  are found with the same lookups as reads, to keep the live counts exact.
- An ingest (a bulk load: rows in a key range no live segment reaches) becomes one new segment
  with no lookup: every row of it is live. Written in ascending key order, such segments form a
  run (:func:`hierps.storage._merge.runs`), which compaction counts and merges as one.
- A lookup of a sorted batch of keys gives each segment the keys in its key range (two searches
  against every segment's first and last keys at once) and asks the filter of each segment given
  some, then reads the one chunk the fences point at for each candidate: keys and rows share
  chunks, so a stored key costs one read, and a key no segment holds costs none (but for the
  filter's ~1% false positives). The reads of all tables and segments go out together.
- Compaction merges segments in bounded memory (:func:`hierps.storage._merge.merged`), keeping
  the newest row of each key that no newer segment outside the merge holds: its output holds only
  live rows, and takes the next id. Segments at most half live, or too many runs, are merged; so
  the live set's segment rows stay within twice the live rows, and its run count bounded. Small
  runs (a small table's write-backs) are merged among themselves once there are more than a few,
  so that a lookup does not ask as many segments as ``max_segments`` allows for tiny ones. A run of
  large segments with disjoint key ranges (a bulk load) counts once and is never merged for being
  many segments: a lookup rules out all but one of them by their key ranges.
- A segment leaving the live set is deleted at once unless a kept checkpoint names it
  (``protected``): checkpoints name segments, they copy nothing. Deleting a key rewrites the
  segments that hold any version of it without it.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from hierps._faults import fault_point
from hierps.errors import StoreFullError
from hierps.rows import _ids
from hierps.storage import _native
from hierps.storage._arrays import Array, encoded_rows_bytes
from hierps.storage._files import (
    OpenFiles,
    Remover,
    Skeletons,
    append_all,
    disk_full_as_error,
    fsync_dir,
    fsync_tree,
    link_tree,
)
from hierps.storage._manifest import SegmentRef
from hierps.storage._merge import merged, run_rows, runs
from hierps.storage._reads import read_arrays
from hierps.storage._segment import (
    SEGMENT_DIRS,
    Segment,
    SegmentWriter,
    bound_name,
    segment_name,
    split_block,
    stored_row_bytes,
)

__all__ = ["SsdTier", "small_runs_held"]


@dataclass
class _Merge:
    """A merge under way: its inputs, the segments newer than they that it checks its rows against,
    their live rows when it began, and the id of the segment it writes."""

    table: str
    inputs: list[Segment]
    newer: list[int]
    live: int
    out: int


# Keys looked up in every segment at a time: bounds the chunks one read request holds (~4 KiB each).
_LOOKUP_KEYS = 1 << 12
# Bytes of chunks a lookup keeps in flight (read, or being read, and not yet matched to its keys).
_READ_AHEAD_BYTES = 16 << 20
# Rows gathered and written per step of a segment write.
_WRITE_SLICE_BYTES = 8 << 20
# A write whose rows leave more than this many segments behind compacts at once (x max_segments).
_HARD_SEGMENTS = 2
# Where retired segments go to be deleted (no table's name starts with a dot).
_TRASH = ".removed"
_SPARE = ".spare"  # segment directories made ahead (storage._files.Skeletons)
# Keys (8 B each) of the segments this process wrote that stay in RAM, the newest segments' first: a
# look-up of which segment holds a key (a write-back's, a merge's; no rows read) searches them there
# instead of reading the segments' chunks. A fixed allowance, whatever the table's size.
_HELD_KEYS_BYTES = 16 << 20
# Runs of at most this many bytes of stored rows count as small for compaction, which merges the
# small runs of a table together once it has more than _SMALL_RUNS of them, whatever max_segments.
_SMALL_RUN_BYTES = 2 << 20
_SMALL_RUNS = 4
# Retired segments of at most this many bytes of rows give their trees to new segments (Skeletons).
_RECYCLE_BYTES = 32 << 20


# The range a segment whose keys are not known yet is taken to span (asked, it loads its fences).
_NO_KEY_LOW, _NO_KEY_HIGH = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def small_runs_held(stored_bytes: float, kept_checkpoints: int) -> float:
    """At most how many bytes of a table's small runs that compaction merged away its kept
    checkpoints may still name (checkpoints name segments, they copy nothing), for a table of
    ``stored_bytes`` on SSD: each kept checkpoint, the small runs of one merge (``_SMALL_RUNS + 1``
    of them where compaction runs after every write-back, as it does after every pass), and never
    more than the table holds."""
    return kept_checkpoints * min(stored_bytes, (_SMALL_RUNS + 1) * _SMALL_RUN_BYTES)


def _ranges(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray, bool]:
    """Each segment's first and last keys, (s,) int64 each: ``_NO_KEY_LOW`` to ``_NO_KEY_HIGH`` where
    not known yet (nothing is read), an empty range (1 to 0) for a segment of no rows; and whether
    every range was known."""
    firsts, lasts = np.empty(len(segments), np.int64), np.empty(len(segments), np.int64)
    known = True
    for i, seg in enumerate(segments):
        span = seg.span
        known &= span is not None or seg.n == 0
        firsts[i], lasts[i] = (1, 0) if seg.n == 0 else (_NO_KEY_LOW, _NO_KEY_HIGH) if span is None else span
    return firsts, lasts, known


def _mark_newest(
    out: tuple[np.ndarray, np.ndarray, np.ndarray], start: int, hit: np.ndarray, seg: int
) -> None:
    """Keys ``start`` on of a lookup's ``(found, holder, rows)`` that segment ``seg`` holds (``hit``):
    found, held by it unless a newer segment (a higher id: segments are numbered as they age) holds
    them, whichever was matched first."""
    found, holder, _ = out
    end = start + len(hit)
    newer = start + np.flatnonzero(hit & ~(found[start:end] & (holder[start:end] > seg)))
    found[newer], holder[newer] = True, seg


class SsdTier:
    """Sorted runs of rows for many tables on disk; RAM holds each run's fences and filter."""

    def __init__(self, root: Path, max_segments: int = 16, *, store_id: str) -> None:
        self.root = Path(root)
        self.store_id = store_id  # the store's id: segment chunks are bound to it
        self.changes = 0  # moves whenever a row read from this tier may read otherwise (not compaction)
        self.root.mkdir(parents=True, exist_ok=True)
        self._zstore = LocalStore(str(self.root))
        self.max_segments = max_segments
        self.widths: dict[str, int] = {}
        self._segs: dict[str, dict[int, Segment]] = {}  # per table, by id (ascending)
        self._live: dict[tuple[str, int], int] = {}  # rows of each segment that are the newest of their key
        # Live rows per table: one int, read without the tier lock (e.g. by pass statistics).
        self._rows: dict[str, int] = {}
        self.protected: set[tuple[str, int]] = set()  # named by a kept checkpoint: its files stay
        self._merging: set[str] = set()  # tables a merge is under way in
        # Segments being written, or written and not in the live set yet (a merge's output before its
        # swap): garbage collection leaves them alone.
        self._writing: set[tuple[str, int]] = set()
        self.next_segment = 1
        self._unsynced: list[tuple[str, int]] = []
        # The keys of some live segments (see _HELD_KEYS_BYTES), oldest held first, and their bytes.
        self._held_keys: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._held_bytes = 0
        self._sync_error: OSError | None = None
        self._files = OpenFiles()  # segment files stay open between reads
        weakref.finalize(self, self._files.close)
        # Retired segments leave their table's directory at once and are deleted in the background.
        self._removed = Remover(self.root / _TRASH)
        # A new segment's 8 directories are made ahead in the background and renamed into place, or
        # a retired segment's tree is (its 6 files cut to their first byte).
        self._skeletons = Skeletons(self.root / _SPARE, SEGMENT_DIRS)
        self.bytes_read = 0
        self.bytes_written = 0
        self.rows_read = 0
        self.rows_written = 0
        self.read_seconds = 0.0  # wall time in read_many (any thread)
        self.write_seconds = 0.0  # wall time in write, the compaction it triggers included

    # -- tables -------------------------------------------------------------------------------
    def add_table(self, table: str, width: int) -> None:
        self._segs.setdefault(table, {})
        self.widths[table] = width

    def num_rows(self, table: str) -> int:
        """Live rows of ``table``: its distinct stored keys."""
        return self._rows.get(table, 0)

    def segments(self, table: str | None = None) -> list[tuple[str, int]]:
        """The live set: ``(table, segment id)``, sorted."""
        return sorted(
            (t, s) for t, segs in list(self._segs.items()) if table in (None, t) for s in list(segs)
        )

    def live_segments(self) -> set[tuple[str, int]]:
        """The live set of every table, as a set."""
        return set(self.segments())

    def segment_size(self, table: str, seg: int) -> int:
        return self._segs[table][seg].n

    def segment_live(self, table: str, seg: int) -> int:
        return self._live[(table, seg)]

    @property
    def index_ram_bytes(self) -> int:
        """Bytes of RAM the tier holds to find keys (fences and filters of the segments loaded so far)."""
        return sum(s.ram_bytes for segs in list(self._segs.values()) for s in list(segs.values()))

    def _segment(self, table: str, seg: int, n: int, check: int, origin: str | None = None) -> Segment:
        return Segment(
            self.root,
            self._zstore,
            table,
            seg,
            n,
            self.widths[table],
            self._files,
            check,
            self.store_id,
            origin,
        )

    # -- lookups ------------------------------------------------------------------------------
    def read(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) int64 sorted unique -> (found (n,) bool, rows (found.sum(), width) float32)."""
        return self.read_many({table: keys})[table]

    def read_many(self, requests: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{table: keys (n,) int64 sorted unique}`` -> ``{table: (found (n,) bool, rows
        (found.sum(), width) float32)}``: the newest row of each stored key, every table's reads
        dispatched together."""
        t0 = time.perf_counter()
        out = {}
        try:
            for table, (found, _, rows) in self._locate(requests, with_rows=True).items():
                hits = int(found.sum())
                out[table] = (found, rows if hits == len(found) else rows[found])
                self.rows_read += hits
                self.bytes_read += hits * 4 * self.widths[table]
        finally:
            self.read_seconds += time.perf_counter() - t0
        return out

    def contains(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) bool: True where a segment holds the key."""
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        uniq, inverse = np.unique(sorted_keys, return_inverse=True)
        found = self._locate({table: uniq}, with_rows=False)[table][0][inverse]
        out = np.empty(len(keys), bool)
        out[order] = found
        return out

    def _locate(
        self, requests: dict[str, np.ndarray], *, with_rows: bool, among: dict[str, list[int]] | None = None
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``{table: keys sorted unique}`` -> ``{table: (found (n,) bool, segment (n,) int64 of the
        newest holder (-1 if none), rows (n, width) float32 (valid where found; empty without
        ``with_rows``))}``, over the live segments (or the ids ``among`` gives per table).

        Keys are looked up ``_LOOKUP_KEYS`` at a time, each slice in every segment newest first: two
        searches of the slice against the segments' first and last keys (all segments at once) give
        each segment the keys of the slice in its range, and only the segments given some are asked
        (:func:`_ranges`), so that the segments of a bulk load (a run, disjoint ranges) cost a slice
        only where its keys fall. The chunks each segment may hold them in are read as one request of
        a single :func:`read_arrays` for the whole lookup, which keeps up to ``_READ_AHEAD_BYTES`` of
        them in flight while the blocks read are matched to the keys."""
        out = {}
        for table, keys in requests.items():
            rows = np.empty((len(keys), self.widths[table]) if with_rows else (0, 0), np.float32)
            out[table] = (np.zeros(len(keys), bool), np.full(len(keys), -1, np.int64), rows)
        wanted: deque[tuple[str, int, np.ndarray, Segment, np.ndarray]] = deque()
        # The segments whose keys are held (see _HELD_KEYS_BYTES) are searched in RAM: without rows,
        # after the reads (table, start, keys, segment); with rows, for the chunks that hold the keys.
        in_ram: list[tuple[str, int, np.ndarray, int]] = []
        held = self._held_keys

        def reads() -> Iterator[tuple[Array, np.ndarray]]:
            for table, keys in requests.items():
                ids = among[table] if among is not None else list(self._segs[table])
                newest_first = [self._segs[table][i] for i in sorted(ids, reverse=True)]
                firsts, lasts, known = _ranges(newest_first)
                for start in range(0, len(keys), _LOOKUP_KEYS):
                    part = np.ascontiguousarray(keys[start : start + _LOOKUP_KEYS])
                    lo = np.searchsorted(part, firsts)  # each segment's keys of the slice: part[lo:hi]
                    hi = np.searchsorted(part, lasts, side="right")
                    for i in np.flatnonzero(hi > lo).tolist():  # newest first
                        seg, a, b = newest_first[i], int(lo[i]), int(hi[i])
                        stored = held.get((table, seg.seg))
                        if stored is not None and not with_rows:
                            in_ram.append((table, start + a, part[a:b], seg.seg))
                            continue
                        if stored is not None:  # exactly the rows of the keys asked: no filter's guess
                            hit, at = _native.find_sorted(stored, part[a:b])
                            which = np.flatnonzero(hit)
                            rows_at = at[which]
                        else:  # the chunks that may hold them
                            which, chunks = seg.candidates(part[a:b])
                            rows_at = seg.chunk_positions(chunks) if len(chunks) else which
                        if len(which):
                            wanted.append((table, start + a, part[a:b], seg, which))
                            yield seg.rows_array, rows_at
                    if not known:  # the segments asked know their ranges now (loaded)
                        firsts, lasts, known = _ranges(newest_first)

        native = _native.enabled()
        blocks = read_arrays(reads(), self._files, ahead_bytes=_READ_AHEAD_BYTES)
        try:
            self._match(blocks, wanted, out, with_rows, native)
        finally:
            blocks.close()  # on an error: the reads in flight end, and their files are released, here
        for table, start, keys, seg_id in in_ram:
            stored = held.get((table, seg_id))
            if stored is None:  # let go meanwhile (a merge looks up without the tier's lock): read it
                self._locate_in(table, seg_id, start, keys, out)
                continue
            _mark_newest(out[table], start, _native.find_sorted(stored, keys)[0], seg_id)
        return out

    def _locate_in(
        self,
        table: str,
        seg_id: int,
        start: int,
        keys: np.ndarray,
        out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    ) -> None:
        """:meth:`_locate` (no rows) of sorted ``keys`` in one segment, into ``out[table]`` at ``start``:
        a key found there is held by it unless a newer segment holds it."""
        found = self._locate({table: keys}, with_rows=False, among={table: [seg_id]})[table][0]
        _mark_newest(out[table], start, found, seg_id)

    def _match(
        self,
        blocks: Iterator[np.ndarray],
        wanted: deque[tuple[str, int, np.ndarray, Segment, np.ndarray]],
        out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        with_rows: bool,
        native: bool,
    ) -> None:
        """Each block read to the keys of its slice (newest segments first): found flags, holders and rows."""
        for block in blocks:
            table, start, keys, seg, which = wanted.popleft()
            found, holder, rows = out[table]
            end, width = start + len(keys), self.widths[table]
            if native and block.dtype == np.float32 and block.flags.c_contiguous:
                # One merge walk of the block's keys with the keys asked (the same as below).
                target = rows[start:end] if with_rows else None
                _native.match_rows(
                    block, width, keys, which, found[start:end], holder[start:end], seg.seg, target
                )
                continue
            stored, stored_rows = split_block(block)
            hit, at = _native.find_sorted(stored, keys[which])
            fresh = hit & ~found[start + which]  # newest first: an older copy is stale
            dest = start + which[fresh]
            found[dest], holder[dest] = True, seg.seg
            if with_rows:
                rows[dest] = stored_rows[at[fresh]]

    # -- scans --------------------------------------------------------------------------------
    def iter_rows(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64 sorted, rows (b, width) float32)``: every live row, in key order,
        a bounded buffer per segment at a time."""
        segs = list(self._segs[table].values())
        for keys, rows, _ in merged(segs, self.widths[table]):
            self.rows_read += len(keys)
            yield keys, rows

    def keys(self, table: str) -> np.ndarray:
        """(n,) int64 sorted: every stored key of ``table``, all in RAM (for small tables and tests)."""
        parts = [keys for keys, _ in self.iter_rows(table)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def scan(self, table: str, columns: slice) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64 sorted, values (b, k) float32)``: ``columns`` of every live row."""
        for keys, rows in self.iter_rows(table):
            yield keys, rows[:, columns]

    # -- writes -------------------------------------------------------------------------------
    def write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        """Append rows as one new segment; they supersede older rows of the same keys.

        keys: (n,) int64 unique (any order); rows: (n, width) float32, or with ``at`` (n,) int64 the
        rows ``rows[at]`` (e.g. slots of a larger array), gathered a slice at a time: memory stays
        bounded however many rows are written.
        """
        self.changes += 1
        if len(keys) == 0:
            return
        t0 = time.perf_counter()
        try:
            self._write(table, keys, rows, at)
        finally:
            self.write_seconds += time.perf_counter() - t0

    def _write(self, table: str, keys: np.ndarray, rows: np.ndarray, at: np.ndarray | None) -> None:
        order = None if _ids.strictly_increasing(keys) else _ids.distinct_order(keys)
        if order is not None:
            keys = keys[order]
        where = at if order is None else (order if at is None else at[order])
        step = max(1, _WRITE_SLICE_BYTES // (4 * self.widths[table]))
        parts = (
            (keys[a : a + step], rows[a : a + step] if where is None else rows[where[a : a + step]])
            for a in range(0, len(keys), step)
        )
        found, holder, _ = self._locate({table: keys}, with_rows=False)[table]
        seg = self._write_segment(table, parts, len(keys), keep_index=True)
        self._hold_keys(seg, keys)
        self._supersede(table, holder[found])
        self._set_live(table, seg.seg, seg.n)
        self.settle(table)

    def disjoint(self, table: str, lo: int, hi: int) -> bool:
        """True when no live segment of ``table`` holds a key in ``[lo, hi]`` (by their key ranges)."""
        spans = (seg.key_range() for seg in list(self._segs[table].values()))
        return all(span is None or span[1] < lo or span[0] > hi for span in spans)

    def ingest(
        self, table: str, parts: Iterable[tuple[np.ndarray, np.ndarray]], n: int, lo: int, hi: int
    ) -> None:
        """Write a bulk load as one new segment: ``parts``, runs of (keys (k,) int64 strictly
        increasing, all above the previous run's, rows (k, width) float32), ``n`` rows in all, every
        key in ``[lo, hi]``, a range no live segment reaches (:meth:`disjoint`, which the caller
        asked). Nothing is looked up: every row is live. Raises ``OSError`` having stored nothing
        (e.g. a full disk); compaction is left to :meth:`settle`."""
        self.changes += 1
        if not self.disjoint(table, lo, hi):
            raise ValueError(f"table {table!r}: an ingest's keys [{lo}, {hi}] reach a live segment's range")

        def within() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, rows in parts:
                if len(keys) and (keys[0] < lo or keys[-1] > hi):
                    raise ValueError(f"table {table!r}: an ingest's keys leave [{lo}, {hi}]")
                yield keys, rows

        t0 = time.perf_counter()
        try:
            seg = self._write_segment(table, within(), n, beside=True)
            self._set_live(table, seg.seg, seg.n)
        finally:
            self.write_seconds += time.perf_counter() - t0

    def settle(self, table: str) -> None:
        """Compact now if the last write left too many runs or too many stale rows (see
        :meth:`_maybe_compact`)."""
        t0 = time.perf_counter()
        try:
            self._maybe_compact(table, _HARD_SEGMENTS * self.max_segments)
        finally:
            self.write_seconds += time.perf_counter() - t0

    def _set_live(self, table: str, seg: int, live: int) -> None:
        self._rows[table] = self._rows.get(table, 0) + live - self._live.get((table, seg), 0)
        self._live[(table, seg)] = live

    def _hold_keys(self, seg: Segment, keys: np.ndarray) -> None:
        """Keep sorted unique ``keys``, every key the new segment ``seg`` holds, in RAM (see
        :data:`_HELD_KEYS_BYTES`), letting the oldest held go past the allowance."""
        if seg.n != len(keys) or keys.nbytes > _HELD_KEYS_BYTES or seg.n == 0:
            return
        keys = np.array(keys, np.int64)  # a copy of its own: the caller's may change
        keys.flags.writeable = False
        self._held_keys[(seg.table, seg.seg)] = keys
        self._held_bytes += keys.nbytes
        while self._held_bytes > _HELD_KEYS_BYTES:
            self._held_bytes -= self._held_keys.popitem(last=False)[1].nbytes

    def _supersede(self, table: str, holders: np.ndarray) -> None:
        """The newest rows of some keys left segments ``holders`` (one entry per key)."""
        if len(holders):
            segs, counts = np.unique(holders, return_counts=True)
            for s, c in zip(segs.tolist(), counts.tolist()):
                self._set_live(table, s, self._live[(table, s)] - c)

    def _new_id(self) -> int:
        seg_id = self.next_segment
        self.next_segment += 1
        return seg_id

    def _write_segment(
        self,
        table: str,
        parts: Iterable[tuple[np.ndarray, np.ndarray]],
        expected: int,
        seg_id: int | None = None,
        *,
        keep_index: bool = False,
        beside: bool = False,
    ) -> Segment:
        """Write runs of (sorted keys, rows) as a new segment of ``table``; registered (in the live set,
        with no live rows yet) unless ``seg_id`` was allocated by the caller, who registers it. With
        ``beside``, each run is encoded and written on a thread of its own while ``parts`` makes the
        next (a bulk load that reads and merges what it writes)."""
        register = seg_id is None
        seg_id = self._new_id() if seg_id is None else seg_id
        name = segment_name(table, seg_id)
        width = self.widths[table]
        fault_point("ssd.segment_begin")
        needed = encoded_rows_bytes(expected, stored_row_bytes(width), 64)
        writer: SegmentWriter | None = None
        self._writing.add((table, seg_id))
        try:
            with disk_full_as_error(self.root / name, f"segment {seg_id} of table {table!r}", needed):
                placed = self._skeletons.place(self.root / name)  # else the writer makes its directories
                writer = SegmentWriter(
                    self._zstore,
                    self.root,
                    name,
                    width,
                    block_point="ssd.segment_rows_block",
                    store_id=self.store_id,
                    keep_index=keep_index,
                    dirs_made=placed,
                )
                append_all(writer.append, parts, beside)
                n, check = writer.close()
            fault_point("ssd.segment_written")
            seg = self._segment(table, seg_id, n, check)
            if writer.key_range is not None:
                seg.known_range(*writer.key_range)
            if writer.index is not None:  # a write-back's segment: its lookups need not read it back
                seg.preload(*writer.index)
        except BaseException:
            # Nothing names the segment yet: close its files and drop what was written of it (a file
            # removed while still open keeps its space in use).
            if writer is not None:
                writer.abort()
            shutil.rmtree(self.root / name, ignore_errors=True)
            self._writing.discard((table, seg_id))
            raise
        if register:
            self._register(seg)
        return seg

    def _register(self, seg: Segment) -> None:
        self._segs[seg.table][seg.seg] = seg
        self._writing.discard((seg.table, seg.seg))
        self._unsynced.append((seg.table, seg.seg))
        self.rows_written += seg.n
        self.bytes_written += seg.n * stored_row_bytes(seg.width)

    def delete(self, table: str, keys: np.ndarray) -> int:
        """Remove ``keys`` from the tier: every segment holding any row of them is rewritten without
        them (at once: no index remembers deletions). Returns how many keys had a row."""
        self.changes += 1
        keys = _ids.distinct(np.asarray(keys, np.int64))
        found = self._locate({table: keys}, with_rows=False)[table][0]
        holding = {
            s
            for s in self._segs[table]
            if self._locate({table: keys}, with_rows=False, among={table: [s]})[table][0].any()
        }
        # The merge counts the rows it drops (its output holds only those it keeps) at its swap: a
        # merge that fails (e.g. on a full disk) leaves every live count as it was.
        if holding:
            self._merge(table, sorted(holding), drop=keys[found])
        return int(found.sum())

    def reset(self, table: str) -> None:
        """Forget every row of ``table`` (kept checkpoints keep theirs)."""
        self.changes += 1
        for seg in list(self._segs[table]):
            self._retire(table, seg)

    # -- compaction ---------------------------------------------------------------------------
    def compact(
        self,
        table: str,
        max_segments: int | None = None,
        min_live_fraction: float = 0.5,
        rewrite: Iterable[int] = (),
        lock: AbstractContextManager[Any] | None = None,
    ) -> int:
        """Merge the segments that are mostly stale, or too many, into one; returns rows written.

        ``rewrite`` names segments to merge whatever their live fraction. With ``lock`` (the lock
        that serialises access to the tier), it is held only to choose the segments and to swap the
        merged one in: reads and writes of other threads go on while the merge reads and writes
        (segments are immutable; the rows a write supersedes meanwhile are counted at the swap).
        """
        with lock or nullcontext():
            if table in self._merging:
                return 0
            chosen = self._choose(table, max_segments or self.max_segments, min_live_fraction, set(rewrite))
            if not chosen:
                return 0
            merge = self._begin_merge(table, chosen)
        return self._finish_merge(merge, None, lock)

    def _maybe_compact(self, table: str, limit: int) -> None:
        """Compact now when a write left more than ``limit`` runs or the disk over twice the live rows."""
        segs = self._segs[table]
        stored = sum(s.n for s in segs.values())
        if table not in self._merging and (
            stored > 2 * self.num_rows(table) + 4096 or (len(segs) > limit and len(self.runs(table)) > limit)
        ):
            self.compact(table)

    def runs(self, table: str) -> list[list[int]]:
        """The live set of ``table`` as runs (:func:`hierps.storage._merge.runs`), oldest first: each a
        list of segment ids whose key ranges are disjoint, which compaction counts and merges as one."""
        segs = list(self._segs[table].values())
        return [[s.seg for s in run] for run in runs(segs, run_rows(self.widths[table]))]

    def _choose(self, table: str, max_segments: int, min_live_fraction: float, forced: set[int]) -> list[int]:
        segs = self._segs[table]
        live = {s: self._live[(table, s)] for s in segs}
        chosen = [s for s in segs if s in forced or live[s] < min_live_fraction * segs[s].n]
        # The units counted and merged: runs (one segment each but for bulk loads), less the segments
        # chosen already.
        as_runs = len(segs) - len(chosen) + 1 > max_segments
        units = self.runs(table) if as_runs else [[s] for s in segs]
        rest = [u for u in ([s for s in run if s not in chosen] for run in units) if u]
        if len(rest) + 1 > max_segments:
            # Too many runs even after merging the stale segments: merge the smallest too.
            size = {id(u): sum(live[s] for s in u) for u in rest}
            ordered = sorted(rest, key=lambda u: size[id(u)])
            pick = ordered[: len(rest) + 1 - max_segments + 1]
            # Size-tiered: a merge that would mostly rewrite one large run to absorb a few small
            # ones costs O(table) per pass; let small runs gather (up to twice max_segments)
            # and merge among themselves until they are worth a quarter of the large one.
            if len(units) <= 2 * max_segments:
                while len(pick) > 1 and size[id(pick[-1])] > 4 * sum(size[id(p)] for p in pick[:-1]):
                    pick.pop()
                if len(pick) < 2:
                    pick = []
            chosen += [s for u in pick for s in u]
        # Small runs (a small table's write-backs, each a few thousand rows) are merged among
        # themselves once there are more than a few: a lookup pays a fixed cost per segment it asks
        # (~0.2 ms of CPU), as much as merging tens of KiB costs once, and with max_segments of them
        # a small table's every lookup asks all of them, pass after pass.
        # (Runs, not segments: a bulk load's run is merged whole or not at all.)
        picked, row_bytes = set(chosen), stored_row_bytes(self.widths[table])

        def is_small(run: list[int]) -> bool:
            return picked.isdisjoint(run) and sum(segs[s].n for s in run) * row_bytes <= _SMALL_RUN_BYTES

        # A small run is made of small segments: counting those first spares a table with few of them
        # the runs' key ranges (read from disk for a segment this process did not write).
        if sum(is_small([s]) for s in segs) > _SMALL_RUNS:
            small = [run for run in (units if as_runs else self.runs(table)) if is_small(run)]
            if len(small) > _SMALL_RUNS:
                chosen += [s for run in small for s in run]
        return sorted(chosen)

    def _merge(self, table: str, chosen: list[int], drop: np.ndarray | None = None) -> int:
        """Rewrite the live rows of segments ``chosen`` (but ``drop``'s keys) as one new segment."""
        return self._finish_merge(self._begin_merge(table, chosen), drop, None)

    def _begin_merge(self, table: str, chosen: list[int]) -> _Merge:
        """What a merge of ``chosen`` starts from (taken with the tier lock held)."""
        fault_point("ssd.compaction_begin")
        segs = self._segs[table]
        merge = _Merge(
            table,
            [segs[s] for s in chosen],
            [s for s in segs if s not in set(chosen) and s > chosen[0]],
            sum(self._live[(table, s)] for s in chosen),
            self._new_id(),
        )
        self._merging.add(table)  # one merge per table at a time: its segments stay while it reads them
        for (
            seg
        ) in merge.inputs:  # a merge scans its inputs, never looks keys up in them: their filters can go
            seg.unload()
        return merge

    def _finish_merge(
        self, merge: _Merge, drop: np.ndarray | None, lock: AbstractContextManager[Any] | None
    ) -> int:
        """Write the merged segment (without the lock), then swap it in (with it)."""
        table = merge.table
        kept: list[np.ndarray] | None = [] if 8 * merge.live <= _HELD_KEYS_BYTES else None
        try:
            parts = self._live_parts(table, merge.inputs, merge.newer, drop, kept)
            out = self._write_segment(table, parts, max(merge.live, 1), seg_id=merge.out)
        except BaseException:
            self._merging.discard(table)
            raise
        with lock or nullcontext():
            try:
                # Rows of the merged segment that writes superseded meanwhile: those the writes took
                # from its inputs' live counts.
                superseded = merge.live - sum(self._live[(table, s.seg)] for s in merge.inputs)
                self._register(out)
                self._set_live(table, out.seg, out.n - superseded)
                if kept:
                    self._hold_keys(out, np.concatenate(kept))
                for s in merge.inputs:
                    self._set_live(table, s.seg, 0)
                    self._retire(table, s.seg)
                fault_point("ssd.compaction")
                if out.n == 0:
                    self._retire(table, out.seg)
            finally:
                self._merging.discard(table)
                self._writing.discard((table, out.seg))
        return out.n

    def _live_parts(
        self,
        table: str,
        inputs: list[Segment],
        newer: list[int],
        drop: np.ndarray | None,
        kept: list[np.ndarray] | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The rows of ``inputs`` that are the newest of their key: not in a ``newer`` segment outside
        the merge (nor in ``drop``), by key; their keys also appended to ``kept`` if given."""
        for keys, rows, seg in merged(inputs, self.widths[table]):
            keep = np.ones(len(keys), bool)
            if drop is not None and len(drop):
                keep &= ~np.isin(keys, drop, assume_unique=True)
            if newer:
                found, holder, _ = self._locate({table: keys}, with_rows=False, among={table: newer})[table]
                keep &= ~(found & (holder > seg))
            self.rows_read += len(keys)
            if keep.any():
                if kept is not None:
                    kept.append(keys[keep])
                yield keys[keep], rows[keep]

    # -- durability ---------------------------------------------------------------------------
    def sync(self) -> None:
        """fsync every segment written since the last sync.

        A failed fsync may have lost written pages (the kernel reports a write-back error once and
        may drop the pages), so it is not retried: this and every later sync raise, and the store
        must be reopened, at its last checkpoint.
        """
        if self._sync_error is not None:
            raise self._sync_error
        # The directories asked for are made before the fsyncs: a checkpoint's file-system calls
        # come in one order, whatever the timing of the thread making them.
        self._skeletons.wait()
        try:
            for table, seg in self._unsynced:
                path = self.root / segment_name(table, seg)
                if path.exists():
                    fsync_tree(path)
            for table in {t for t, _ in self._unsynced}:
                fsync_dir(self.root / table)
            fsync_dir(self.root)
        except OSError as exc:
            why = "no space left on the device" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            message = (
                f"{self.root}: fsync of new segments failed ({why}); rows written since the last "
                "checkpoint may not be on disk. Close the store and open it again: it reopens at its "
                "last checkpoint."
            )
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._sync_error = (
                StoreFullError(message, str(self.root)) if full else OSError(exc.errno, message)
            )
            raise self._sync_error from exc
        self._unsynced.clear()

    def live_set(self, table: str) -> dict[int, SegmentRef]:
        """What a checkpoint records of ``table``'s live set: ``{id: (rows, live rows, fences_check)}``."""
        return {
            s: SegmentRef(seg.n, self._live[(table, s)], seg.check, seg.origin)
            for s, seg in self._segs[table].items()
        }

    def load_segments(self, table: str, width: int, segments: Mapping[int, SegmentRef]) -> None:
        """Replace the live set of ``table`` by ``{id: (rows, live rows, check)}`` (from a checkpoint)."""
        self.changes += 1
        self.add_table(table, width)
        for seg in list(self._segs[table]):
            self._drop(table, seg)
        for seg, (n, live, check, origin) in sorted(segments.items()):
            self._segs[table][seg] = self._segment(table, seg, n, check, origin)
            self._set_live(table, seg, live)

    def adopt(self, table: str, source: Path, source_id: str, segments: Mapping[int, SegmentRef]) -> None:
        """Add to ``table``'s live set the ``segments`` of another store's checkpoint (its segments
        directory ``source``, its id ``source_id``), none of whose keys this table holds: each linked
        in under a new id, in their order (a newer segment's rows stay the newer), not a byte read or
        written. Their chunks keep the binding tags they were written with (``SegmentRef.origin``).
        Like a written segment, an adopted one is durable at the next :meth:`sync` and counts once a
        checkpoint names it. ``OSError`` when a link cannot be made (another file system:
        ``EXDEV``), with the segments linked so far in the live set."""
        os.makedirs(self.root / table, exist_ok=True)
        for seg, ref in sorted(segments.items()):
            name = segment_name(table, seg)
            new = self.next_segment
            self.next_segment += 1
            link_tree(source / name, self.root / segment_name(table, new))
            self.changes += 1
            origin = ref.origin if ref.origin is not None else bound_name(source_id, name)
            self._segs[table][new] = self._segment(table, new, ref.rows, ref.check, origin)
            self._set_live(table, new, ref.live)
            self._unsynced.append((table, new))
            fault_point("ssd.adopted_segment")

    def _drop(self, table: str, seg: int) -> None:
        """Take a segment out of the live set (its files stay)."""
        gone = self._segs[table].pop(seg)
        held = self._held_keys.pop((table, seg), None)
        self._held_bytes -= 0 if held is None else held.nbytes
        self._set_live(table, seg, 0)
        self._live.pop((table, seg), None)
        self._files.forget_under(gone.path)

    def _retire(self, table: str, seg: int) -> None:
        """Take a segment out of the live set, deleting it unless a kept checkpoint names it: its tree
        goes back to the trees new segments are written into (files cut to their first byte), or is deleted.

        Nothing reads it any more: reads of the live set hold the tier's lock, as a retirement does,
        and a merge retires its inputs once it has read them; kept checkpoints' segments, which other
        readers open, are never retired (they leave through :meth:`collect_garbage`)."""
        rows_bytes = self._segs[table][seg].n * stored_row_bytes(self.widths[table])
        self._drop(table, seg)
        if (table, seg) not in self.protected:
            path = self.root / segment_name(table, seg)
            # A large tree is deleted in the background: emptying its files would hold up the
            # writer that takes it, and making its few files again costs little beside its bytes.
            if rows_bytes > _RECYCLE_BYTES or not self._skeletons.recycle(path):
                self._removed.remove(path)
            fault_point("ssd.gc_segment")

    def collect_garbage(self, keep: set[tuple[str, int]]) -> int:
        """Delete segment directories named neither in ``keep`` (the kept checkpoints' segments,
        protected from now on) nor by the live set, nor being written."""
        self.protected = set(keep)
        keep = keep | set(self.segments()) | set(self._writing)
        removed = 0
        if not self.root.exists():
            return 0
        self._removed.empty()
        self._skeletons.empty()
        for tdir in self.root.iterdir():
            if not tdir.is_dir():
                continue
            for sdir in tdir.iterdir():
                if not (sdir.is_dir() and sdir.name.isdigit()):
                    continue
                if (tdir.name, int(sdir.name)) not in keep:
                    shutil.rmtree(sdir, ignore_errors=True)
                    removed += 1
                    fault_point("ssd.gc_segment")
        return removed

    def max_segment_on_disk(self) -> int:
        best = 0
        if self.root.exists():
            for tdir in self.root.iterdir():
                if tdir.is_dir():
                    for sdir in tdir.iterdir():
                        if sdir.name.isdigit():
                            best = max(best, int(sdir.name))
        return best

    def disk_bytes(self) -> int:
        """Bytes of the files under the tier's directory now. The pipeline's worker may merge and
        collect segments meanwhile: a file or directory removed during the walk counts as gone."""
        self._removed.wait()  # retired segments still being deleted are gone
        self._skeletons.wait()  # and those given back to the trees made ahead are cut
        total = 0
        for folder, _, files in os.walk(self.root):  # a folder removed meanwhile is skipped
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    pass  # removed since the walk listed it
        return total

    def wait_removals(self) -> None:
        """Block until the retired segments handed to the background threads so far are deleted, or
        cut to be written into again."""
        self._removed.wait()
        self._skeletons.wait()

    def close(self) -> None:
        """Close the segment files kept open for reads (they reopen on the next read), once retired
        segments are deleted."""
        self._removed.close()
        self._skeletons.close()
        self._files.close()
