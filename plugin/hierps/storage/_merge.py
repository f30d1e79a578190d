"""Merging sorted runs in bounded memory: the newest row of each key over several segments.

A table's segments are sorted runs of keys; a key may lie in several of them, and the one with
the highest segment id holds its newest row. :func:`merged` streams the union of some segments in
key order, the newest row of each key once, holding one buffer of each input at a time: the
compaction, the scans (shrink, export, resharding, inspection) and the readers all go through it.

Segments of a run (a block of consecutive segments, by id, whose key ranges are pairwise disjoint,
as a bulk load writes them: :func:`runs`) are one input, read one segment after the other in key
order: the inputs of a merge are its runs, however many segments each holds.

Each batch of the inputs' buffered rows is merged in one pass by the compiled core
(:mod:`hierps.storage._native`), or, without it, sorted with ``np.lexsort`` (the reference it is
tested against).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np

from hierps.storage import _native
from hierps.storage._segment import Segment

__all__ = ["BUFFER_BYTES", "RUN_BYTES", "first_of_each", "merged", "merged_sources", "run_rows", "runs"]

# Bytes each input of a merge holds in RAM at a time, at least: a merge of few inputs (an export or a
# scan of one run) shares MERGE_BYTES among them, so that each batch's fixed costs (its reads handed to
# the read threads, the merge, the caller's own work) are spread over more rows.
BUFFER_BYTES = 512 << 10
MERGE_BYTES = 4 << 20
# Segments of at least this many bytes of rows join runs (smaller ones stay runs of their own).
RUN_BYTES = 32 << 20


def run_rows(width: int) -> int:
    """Rows of ``width`` floats a segment holds at least to join a run (:data:`RUN_BYTES` of rows)."""
    return max(1, RUN_BYTES // (4 * (width + 2)))


def runs(segments: Sequence[Segment], min_rows: int) -> list[list[Segment]]:
    """``segments`` grouped into runs, oldest first: blocks of consecutive segments (by id) of at
    least ``min_rows`` rows each whose key ranges are pairwise disjoint, each run in key order; a
    smaller segment is a run of its own. Every segment of a run is older than every segment of a
    later run, and a key lies in one segment of a run at most. Reads the first and last rows of a
    segment whose key range is not known yet (:meth:`Segment.key_range`)."""
    out: list[list[Segment]] = []
    firsts: list[int] = []  # first keys of the run being gathered, ascending
    current: list[Segment] = []  # its segments, in the same order
    for seg in sorted(segments, key=lambda s: s.seg):
        span = seg.key_range() if seg.n >= min_rows else None
        if span is not None and current:
            at = bisect.bisect_left(firsts, span[0])
            before = current[at - 1].key_range() if at else None
            after = firsts[at] if at < len(firsts) else None
            if (before is None or before[1] < span[0]) and (after is None or after > span[1]):
                firsts.insert(at, span[0])
                current.insert(at, seg)
                continue
        if current:
            out.append(current)
        firsts, current = ([span[0]], [seg]) if span is not None else ([], [])
        if span is None:
            out.append([seg])
    if current:
        out.append(current)
    return out


class _Input:
    """One sorted source of ``(keys, rows)`` batches, read a batch at a time."""

    def __init__(self, source: Iterator[tuple[np.ndarray, np.ndarray]], rank: int, width: int) -> None:
        self.rank = rank
        self._source = source
        self.keys = np.empty(0, np.int64)
        self.rows = np.empty((0, width), np.float32)
        self.at = 0
        self.done = False
        self._refill()

    def _refill(self) -> None:
        part = next(self._source, None)
        while part is not None and len(part[0]) == 0:
            part = next(self._source, None)
        if part is None:
            self.done = True
            self.keys = self.keys[:0]
        else:
            self.keys, self.rows = part
        self.at = 0

    @property
    def last(self) -> int:
        return int(self.keys[-1])

    def take(self, bound: int) -> tuple[np.ndarray, np.ndarray]:
        """Buffered keys <= ``bound`` and their rows, refilling when the buffer is used up."""
        end = int(np.searchsorted(self.keys, bound, side="right"))
        out = self.keys[self.at : end], self.rows[self.at : end]
        self.at = end
        if self.at == len(self.keys):
            self._refill()
        return out


def merged_sources(
    sources: Sequence[Iterator[tuple[np.ndarray, np.ndarray]]], width: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Merge sorted sources of ``(keys (b,) int64, rows (b, width) float32)`` batches (each source's
    keys strictly increasing): yield ``(keys, rows, source index)`` batches sorted by key, then by
    source index descending, every entry of a key within one batch (duplicates kept). A lone
    source's batches come as they are (its rows perhaps a view of a wider array).

    Memory: one batch of each source, plus the batch yielded.
    """
    return _merged(sources, width, newest_only=False)


def _merged(
    sources: Sequence[Iterator[tuple[np.ndarray, np.ndarray]]], width: int, newest_only: bool
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`merged_sources`, or with ``newest_only`` only the first entry of each key (its newest)."""
    if len(sources) == 1:  # nothing to merge: the source's batches as they come
        for keys, rows in sources[0]:
            if len(keys):
                yield keys, rows, np.zeros(len(keys), np.int64)
        return
    inputs = [i for i in (_Input(src, r, width) for r, src in enumerate(sources)) if not i.done]
    while inputs:
        bound = min(i.last for i in inputs)  # every input's keys up to here are buffered
        yield _combine([(i.rank, *i.take(bound)) for i in inputs], newest_only)
        inputs = [i for i in inputs if not i.done]


def _combine(
    parts: list[tuple[int, np.ndarray, np.ndarray]], newest_only: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parts ``(rank, keys, rows)`` (keys strictly increasing in each) -> their entries sorted by key,
    then rank descending (``newest_only``: the first of each key)."""
    rows0 = parts[0][2]
    if _native.enabled() and all(
        r.ndim == 2 and r.dtype == rows0.dtype and r.shape[1] == rows0.shape[1] and k.dtype == np.int64
        for _, k, r in parts
    ):
        total = sum(len(k) for _, k, _ in parts)
        keys, src = np.empty(total, np.int64), np.empty(total, np.int64)
        rows = np.empty((total, rows0.shape[1]), rows0.dtype)
        n = _native.merge_runs(
            [np.ascontiguousarray(k) for _, k, _ in parts],
            [
                r if r.strides[1] == r.itemsize and r.strides[0] >= 0 else np.ascontiguousarray(r)
                for _, _, r in parts
            ],
            np.array([rank for rank, _, _ in parts], np.int64),
            newest_only,
            keys,
            rows,
            src,
        )
        return keys[:n], rows[:n], src[:n]
    keys = np.concatenate([k for _, k, _ in parts])
    rows = np.concatenate([r for _, _, r in parts])
    src = np.concatenate([np.full(len(k), r, np.int64) for r, k, _ in parts])
    order = np.lexsort((-src, keys))
    keys, rows, src = keys[order], rows[order], src[order]
    if newest_only:
        first = first_of_each(keys)
        return keys[first], rows[first], src[first]
    return keys, rows, src


def first_of_each(keys: np.ndarray) -> np.ndarray:
    """(b,) sorted keys -> (b,) bool: True at the first entry of each key."""
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    return first


class _RunScan:
    """The rows of a run's segments in key order: one :meth:`Segment.scan` at a time."""

    def __init__(self, run: list[Segment], batch_rows: int) -> None:
        self.run = run
        self._batch_rows = batch_rows
        self.ids = np.array([s.seg for s in run], np.int64)
        spans = [s.key_range() for s in run] if len(run) > 1 else []
        self._firsts = np.array([span[0] for span in spans if span is not None], np.int64)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for seg in self.run:
            yield from seg.scan(self._batch_rows)  # closing this closes the scan under way

    def segment_of(self, keys: np.ndarray) -> np.ndarray:
        """(b,) keys of this run -> (b,) int64 ids of the segments holding them."""
        if len(self.run) == 1:
            return np.full(len(keys), self.ids[0], np.int64)
        return self.ids[np.searchsorted(self._firsts, keys, side="right") - 1]


def merged(
    segments: Sequence[Segment], width: int, buffer_bytes: int = BUFFER_BYTES
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(keys (b,) int64 sorted unique, rows (b, width) float32, segment of each (b,) int64)``
    over ``segments``: every key once, with its row from the newest of them that holds it. The rows
    are the merge's own (a view of the segment's block read, where one input is merged).

    The segments of a run (:func:`runs`) are one input. Memory: per input, the buffer being merged
    (``buffer_bytes``, or a share of :data:`MERGE_BYTES` where that is more) and the next two read
    ahead (:meth:`Segment.scan`).
    """
    # Runs oldest first: a higher source index is a newer segment wherever two inputs hold a key.
    grouped = runs(segments, run_rows(width))
    batch_rows = max(1, max(buffer_bytes, MERGE_BYTES // max(1, len(grouped))) // (4 * (width + 2)))
    inputs = [_RunScan(run, batch_rows) for run in grouped]
    scans = [iter(i) for i in inputs]
    single = all(len(i.run) == 1 for i in inputs)
    ids = np.array([i.ids[0] for i in inputs], np.int64)
    try:
        for keys, rows, src in _merged(scans, width, newest_only=True):
            if single:
                yield keys, rows, ids[src]
            elif len(inputs) == 1:  # one run: every key is its own
                yield keys, rows, inputs[0].segment_of(keys)
            else:
                segs = np.empty(len(keys), np.int64)
                for s in np.unique(src).tolist():
                    at = src == s
                    segs[at] = inputs[s].segment_of(keys[at])
                yield keys, rows, segs
    finally:
        for scan in scans:  # closed early (an error, a consumer that stopped): their reads end here
            scan.close()  # type: ignore[attr-defined]
