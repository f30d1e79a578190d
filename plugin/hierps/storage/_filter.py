"""A blocked Bloom filter of int64 keys: which keys a sorted run (an SSD segment, a table of an export)
may hold, from RAM.

Each key sets ``_FILTER_PROBES`` bits in one 64-bit word chosen by its hash, so a query costs one
cache line. At 12 bits per key about 1% of absent keys pass. Beside the fences of a run (the first
key of each chunk) the filter keeps the run's RAM under ``_RAM_PER_KEY`` bytes per key.
"""

from __future__ import annotations

import numpy as np

from hierps.rows._initializers import splitmix64

__all__ = ["bloom_add", "bloom_build", "bloom_may_contain", "filter_words"]

_FILTER_BITS = 12  # Bloom filter bits per key: ~1% false positives (fewer for wide rows, see below)
_RAM_PER_KEY = 1.9  # bytes of fences and filter per key a run may hold in RAM
_FILTER_PROBES = 6  # bits set per key, all in one 64-bit word (one cache line per probe)


def filter_words(n: int, chunk_rows: int = 1 << 30) -> int:
    """Filter words for ``n`` keys: 12 bits each, or fewer where wide rows (few rows per chunk, so
    more fences per key: one per ``chunk_rows``) would take the fences and filter over ``_RAM_PER_KEY``."""
    bits = min(_FILTER_BITS, int((_RAM_PER_KEY - 8 / chunk_rows) * 8))
    return max(1, (n * bits + 63) // 64)


def _probes(keys: np.ndarray, n_words: int) -> tuple[np.ndarray, np.ndarray]:
    """keys (n,) int64 -> (word of each key (n,) int64, the bits it sets there (n,) uint64)."""
    with np.errstate(over="ignore"):
        h = splitmix64(np.ascontiguousarray(keys, np.int64).view(np.uint64))
        word = ((h >> np.uint64(32)) * np.uint64(n_words)) >> np.uint64(32)
        h2 = splitmix64(h)
    mask = np.zeros(len(keys), np.uint64)
    for i in range(_FILTER_PROBES):
        mask |= np.uint64(1) << ((h2 >> np.uint64(6 * i)) & np.uint64(63))
    return word.astype(np.int64), mask


def bloom_build(keys: np.ndarray, n_words: int | None = None) -> np.ndarray:
    """A filter of ``keys`` (n,) int64: (w,) uint64 words."""
    words = np.zeros(n_words if n_words is not None else filter_words(len(keys)), np.uint64)
    bloom_add(words, keys)
    return words


def bloom_add(words: np.ndarray, keys: np.ndarray) -> None:
    """Set the bits of ``keys`` in the filter ``words``."""
    if len(keys):
        word, mask = _probes(keys, len(words))
        np.bitwise_or.at(words, word, mask)


def bloom_may_contain(words: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """keys (n,) int64 -> (n,) bool: False where the filter ``words`` proves a key absent."""
    word, mask = _probes(keys, len(words))
    return (words[word] & mask) == mask
