"""A bounded cache of served rows: 8-way set-associative, least recently used out of each set.

A key's hash picks one set of 8 slots; a lookup compares the key with the 8 keys there, so a batch
of ids is found with a few numpy gathers, without a Python object per row. A row read from disk
takes the least recently used slot of its set. Memory is fixed when the cache is made:
``4 * dim + 16`` bytes per slot (the row, its key and its last use), allocated lazily by the OS as
slots fill.

Rows are valid for one *generation* of the served exports. A lookup of an older generation
neither reads nor fills the cache, so the cache never mixes rows of two generations; applying a
delta drops the rows it touches (or all of them) and moves the cache to the new generation.
Thread-safe: every method holds the cache's lock, only for numpy work (no I/O).
"""

from __future__ import annotations

import threading

import numpy as np

from hierps.rows._initializers import splitmix64

__all__ = ["WAYS", "RowCache"]

WAYS = 8


class RowCache:
    """At most ``capacity_bytes`` of rows of ``dim`` float32 (0: caches nothing)."""

    def __init__(self, capacity_bytes: int, dim: int, generation: int = 0) -> None:
        self.dim = dim
        self.sets = self.rows_for(capacity_bytes, dim) // WAYS
        self.generation = generation
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._tick = 0
        self._keys = np.zeros((self.sets, WAYS), np.int64)
        self._used = np.zeros((self.sets, WAYS), np.int64)  # last use (a tick); 0: empty
        self._rows = np.zeros((self.sets, WAYS, dim), np.float32)

    @staticmethod
    def rows_for(capacity_bytes: int, dim: int) -> int:
        """Rows a cache of ``capacity_bytes`` holds: whole sets of ``WAYS`` slots of ``4 * dim + 16`` bytes."""
        return max(0, capacity_bytes // (WAYS * (4 * dim + 16))) * WAYS

    @property
    def capacity(self) -> int:
        """Rows it holds at most."""
        return self.sets * WAYS

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._used.nbytes + self._rows.nbytes

    def _set_of(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = splitmix64(np.ascontiguousarray(ids, np.int64).view(np.uint64))
        return (((h >> np.uint64(32)) * np.uint64(self.sets)) >> np.uint64(32)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(set of each id, whether it is cached, its way there)."""
        sets = self._set_of(ids)
        match = (self._keys[sets] == ids[:, None]) & (self._used[sets] > 0)
        return sets, match.any(axis=1), match.argmax(axis=1)

    def get(self, ids: np.ndarray, generation: int) -> tuple[np.ndarray, np.ndarray]:
        """ids (k,) int64 unique -> (cached (k,) bool, their rows (h, dim) float32); nothing is cached
        for another generation than the cache's."""
        with self._lock:
            if generation != self.generation or self.sets == 0 or len(ids) == 0:
                self.misses += len(ids)
                return np.zeros(len(ids), bool), np.empty((0, self.dim), np.float32)
            sets, hit, way = self._find(ids)
            self._tick += 1
            self._used[sets[hit], way[hit]] = self._tick
            self.hits += int(hit.sum())
            self.misses += int((~hit).sum())
            return hit, self._rows[sets[hit], way[hit]]

    def put(self, ids: np.ndarray, rows: np.ndarray, generation: int) -> None:
        """Cache rows (k, dim) of ids (k,) unique of ``generation`` (ignored for another generation)."""
        with self._lock:
            if generation != self.generation or self.sets == 0 or len(ids) == 0:
                return
            sets, hit, _ = self._find(ids)  # another lookup may have cached some meanwhile
            ids, rows, sets = ids[~hit], rows[~hit], sets[~hit]
            order = np.argsort(sets, kind="stable")
            ids, rows, sets = ids[order], rows[order], sets[order]
            first = np.ones(len(sets), bool)
            first[1:] = sets[1:] != sets[:-1]
            starts = np.flatnonzero(first)
            rank = np.arange(len(sets)) - np.repeat(starts, np.diff(np.append(starts, len(sets))))
            keep = rank < WAYS  # more new rows than ways in a set: the first WAYS of them
            by_age = np.argsort(self._used[sets[keep]], axis=1, kind="stable")  # empty and oldest first
            way = by_age[np.arange(int(keep.sum())), rank[keep]]
            self._tick += 1
            self._keys[sets[keep], way] = ids[keep]
            self._rows[sets[keep], way] = rows[keep]
            self._used[sets[keep], way] = self._tick

    def advance(self, generation: int, touched: np.ndarray | None) -> None:
        """Move to ``generation``: drop the rows of ``touched`` (k,) int64 keys, or every row (None)."""
        with self._lock:
            if touched is None:
                self._used[:] = 0
            elif self.sets and len(touched):
                sets, hit, way = self._find(np.ascontiguousarray(touched, np.int64))
                self._used[sets[hit], way[hit]] = 0
            self.generation = generation
