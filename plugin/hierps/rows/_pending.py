"""Keys without a row yet: their sighting counts, exact and bounded, saved with each checkpoint.

Under an :class:`~hierps.config.AdmissionConfig` that filters, a key is *pending* until it earns a
row: :class:`PendingKeys` keeps its sighting count, and :func:`hierps.lifecycle._admission.admitted`
decides at each sighting whether it now gets its row.

Why exact counts in a bounded table, not a counting Bloom filter or a count-min sketch: a sketch
over-counts on collisions, so a key seen once could be admitted; exact counts never admit a key
before its ``min_count``-th sighting. Memory is bounded by ``max_pending`` keys per table (16
bytes each: key, count, last pass): when full, the keys seen least recently (then least often)
are forgotten and start counting anew if they return. The only error is admitting a long-idle
key later than it could have been, and the keys forgotten are the ones ads logs are full of:
seen once, never again. Pending counts are saved with each checkpoint (the three arrays of
:data:`PENDING_ARRAYS` per table, next to its key index), so restoring a checkpoint restores the
counts that go with its rows.
"""

from __future__ import annotations

import numpy as np

from hierps.rows._ids import find_sorted

__all__ = ["PENDING_ARRAYS", "PendingKeys"]

# The arrays a checkpoint saves per table: name -> dtype.
PENDING_ARRAYS = {"pending_keys": "int64", "pending_count": "int32", "pending_pass": "int32"}
# After forgetting, the table holds this fraction of its capacity: forgetting runs in batches.
_KEEP_FRACTION = 0.875
_COUNT_MAX = np.iinfo(np.int32).max


class PendingKeys:
    """Sighting counts of one table's keys that have no row: parallel arrays sorted by key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.keys = np.empty(0, np.int64)
        self.count = np.empty(0, np.int32)
        self.last_pass = np.empty(0, np.int32)
        self.forgotten = 0  # keys dropped to stay within capacity, since the store opened

    def __len__(self) -> int:
        return len(self.keys)

    def see(self, keys: np.ndarray, counts: np.ndarray, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Count sightings: keys (n,) sorted unique int64, counts (n,) int64 -> (before, after) (n,) int64."""
        found, at = find_sorted(self.keys, keys)
        before = np.zeros(len(keys), np.int64)
        before[found] = self.count[at[found]]
        after = before + counts.astype(np.int64)
        self.count[at[found]] = np.minimum(after[found], _COUNT_MAX)
        self.last_pass[at[found]] = now
        new = ~found
        if new.any():
            ins = np.searchsorted(self.keys, keys[new])
            self.keys = np.insert(self.keys, ins, keys[new])
            self.count = np.insert(self.count, ins, np.minimum(after[new], _COUNT_MAX).astype(np.int32))
            self.last_pass = np.insert(self.last_pass, ins, np.int32(now))
        return before, after

    def count_of(self, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) int64 sightings counted so far (0 for keys not pending)."""
        keys = np.asarray(keys, dtype=np.int64)
        found, at = find_sorted(self.keys, keys)
        out = np.zeros(len(keys), np.int64)
        out[found] = self.count[at[found]]
        return out

    def remove(self, keys: np.ndarray) -> None:
        """Forget ``keys`` (admitted, written or deleted); keys not pending are ignored."""
        found, at = find_sorted(self.keys, np.asarray(keys, dtype=np.int64))
        if found.any():
            keep = np.ones(len(self.keys), bool)
            keep[at[found]] = False
            self._keep(np.flatnonzero(keep))

    def bound(self) -> int:
        """Forget the least recently (then least often) seen keys past capacity; returns how many."""
        if len(self.keys) <= self.capacity:
            return 0
        keep_n = int(self.capacity * _KEEP_FRACTION)
        order = np.lexsort((self.count, self.last_pass))  # oldest first, least counted first
        dropped = len(self.keys) - keep_n
        self._keep(np.sort(order[dropped:]))
        self.forgotten += dropped
        return dropped

    def prune(self, seen_before: int) -> int:
        """Forget keys last seen before pass ``seen_before``; returns how many."""
        old = self.last_pass < seen_before
        if old.any():
            self._keep(np.flatnonzero(~old))
        return int(old.sum())

    def _keep(self, positions: np.ndarray) -> None:
        self.keys, self.count, self.last_pass = (
            self.keys[positions],
            self.count[positions],
            self.last_pass[positions],
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a checkpoint saves, named as in :data:`PENDING_ARRAYS`."""
        return dict(zip(PENDING_ARRAYS, (self.keys, self.count, self.last_pass)))

    @classmethod
    def from_arrays(cls, capacity: int, arrays: dict[str, np.ndarray] | None) -> PendingKeys:
        """The table a checkpoint saved (None: empty)."""
        out = cls(capacity)
        if arrays:
            keys, count, last = (np.asarray(arrays[name]) for name in PENDING_ARRAYS)
            out.keys, out.count, out.last_pass = (
                keys.astype(np.int64),
                count.astype(np.int32),
                last.astype(np.int32),
            )
        return out
