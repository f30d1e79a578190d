"""The key index of a table: where each key's row lies (segment, position in the segment)."""

from __future__ import annotations

import numpy as np

__all__ = ["TableIndex", "find_sorted"]


def find_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found (n,) bool, position in sorted_keys (n,), clamped) of each key."""
    if len(sorted_keys) == 0:
        return np.zeros(len(keys), bool), np.zeros(len(keys), np.int64)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys, at


class TableIndex:
    """key -> (segment, position): 16 bytes per key, as parallel arrays sorted by key.

    Two levels keep a write proportional to the rows written, not to the table: new keys go to
    a small sorted delta, merged into the main arrays once it exceeds 1/8 of them (amortised
    O(1) per key). ``keys`` / ``seg`` / ``pos`` give the merged arrays.
    """

    def __init__(
        self, keys: np.ndarray | None = None, seg: np.ndarray | None = None, pos: np.ndarray | None = None
    ) -> None:
        self._k = np.empty(0, np.int64) if keys is None else keys
        self._s = np.empty(0, np.int32) if seg is None else seg
        self._p = np.empty(0, np.int32) if pos is None else pos
        self._dk, self._ds, self._dp = np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int32)

    def __len__(self) -> int:
        return len(self._k) + len(self._dk)

    def _merge(self) -> None:
        if len(self._dk):
            at = np.searchsorted(self._k, self._dk)
            self._k = np.insert(self._k, at, self._dk)
            self._s = np.insert(self._s, at, self._ds)
            self._p = np.insert(self._p, at, self._dp)
            self._dk, self._ds, self._dp = self._dk[:0], self._ds[:0], self._dp[:0]

    @property
    def keys(self) -> np.ndarray:
        self._merge()
        return self._k

    @property
    def seg(self) -> np.ndarray:
        self._merge()
        return self._s

    @property
    def pos(self) -> np.ndarray:
        self._merge()
        return self._p

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._k, self._s, self._p, self._dk, self._ds, self._dp))

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (found (n,) bool, positions in the merged ``keys`` / ``seg`` / ``pos``)."""
        self._merge()
        return find_sorted(self._k, keys)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (found (n,) bool, segment (n,), position (n,)); valid where found."""
        f1, a1 = find_sorted(self._k, keys)
        f2, a2 = find_sorted(self._dk, keys)
        seg = np.where(f1, self._s[a1] if len(self._k) else 0, self._ds[a2] if len(self._dk) else 0)
        pos = np.where(f1, self._p[a1] if len(self._k) else 0, self._dp[a2] if len(self._dk) else 0)
        return f1 | f2, seg.astype(np.int32), pos.astype(np.int32)

    def assign(self, keys: np.ndarray, seg: int, positions: np.ndarray) -> np.ndarray:
        """Point sorted unique ``keys`` at ``seg`` / ``positions``; returns the segments they left."""
        f1, a1 = find_sorted(self._k, keys)
        f2, a2 = find_sorted(self._dk, keys)
        f2 &= ~f1
        old = np.concatenate([self._s[a1[f1]], self._ds[a2[f2]]])
        self._s[a1[f1]], self._p[a1[f1]] = seg, positions[f1]
        self._ds[a2[f2]], self._dp[a2[f2]] = seg, positions[f2]
        new = ~(f1 | f2)
        if new.any():
            at = np.searchsorted(self._dk, keys[new])
            self._dk = np.insert(self._dk, at, keys[new])
            self._ds = np.insert(self._ds, at, np.int32(seg))
            self._dp = np.insert(self._dp, at, positions[new].astype(np.int32))
            if len(self._dk) > max(1 << 16, len(self._k) // 8):
                self._merge()
        return old

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Drop ``keys`` (sorted unique); returns the segments of those that were present."""
        self._merge()
        found, at = find_sorted(self._k, keys)
        at = at[found]
        old = self._s[at]
        keep = np.ones(len(self._k), bool)
        keep[at] = False
        self._k, self._s, self._p = self._k[keep], self._s[keep], self._p[keep]
        return old
