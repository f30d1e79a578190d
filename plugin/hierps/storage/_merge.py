"""Merging sorted runs in bounded memory: the newest row of each key over several segments.

A table's segments are sorted runs of keys; a key may lie in several of them, and the one with
the highest segment id holds its newest row. :func:`merged` streams the union of some segments in
key order, the newest row of each key once, holding one buffer of each input at a time: the
compaction, the scans (shrink, export, resharding, inspection) and the readers all go through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from hierps.storage._segment import Segment

__all__ = ["BUFFER_BYTES", "first_of_each", "merged", "merged_sources"]

# Bytes each input of a merge holds in RAM at a time.
BUFFER_BYTES = 512 << 10


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
    source index descending, every entry of a key within one batch (duplicates kept).

    Memory: one batch of each source, plus the batch yielded.
    """
    if len(sources) == 1:  # nothing to merge: the source's batches as they come
        for keys, rows in sources[0]:
            if len(keys):
                yield keys, rows, np.zeros(len(keys), np.int64)
        return
    inputs = [i for i in (_Input(src, r, width) for r, src in enumerate(sources)) if not i.done]
    while inputs:
        bound = min(i.last for i in inputs)  # every input's keys up to here are buffered
        parts = [(i.rank, *i.take(bound)) for i in inputs]
        keys = np.concatenate([k for _, k, _ in parts])
        rows = np.concatenate([r for _, _, r in parts])
        src = np.concatenate([np.full(len(k), r, np.int64) for r, k, _ in parts])
        order = np.lexsort((-src, keys))
        yield keys[order], rows[order], src[order]
        inputs = [i for i in inputs if not i.done]


def first_of_each(keys: np.ndarray) -> np.ndarray:
    """(b,) sorted keys -> (b,) bool: True at the first entry of each key."""
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    return first


def merged(
    segments: Sequence[Segment], width: int, buffer_bytes: int = BUFFER_BYTES
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(keys (b,) int64 sorted unique, rows (b, width) float32, segment of each (b,) int64)``
    over ``segments``: every key once, with its row from the newest of them that holds it.

    Memory: one buffer of ``buffer_bytes`` per input.
    """
    batch_rows = max(1, buffer_bytes // (4 * (width + 2)))
    ordered = sorted(segments, key=lambda s: s.seg)  # a higher source index is a newer segment
    ids = np.array([s.seg for s in ordered], np.int64)
    for keys, rows, src in merged_sources([s.scan(batch_rows) for s in ordered], width):
        first = first_of_each(keys)
        yield keys[first], rows[first], ids[src[first]]
