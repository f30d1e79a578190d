"""Blocked Bloom filters of int64 keys: which keys a sorted run (an SSD segment, a table of an export)
may hold, from RAM.

Each key sets ``_FILTER_PROBES`` bits in one 64-bit word chosen by its hash, so a query costs one
cache line. At 12 bits per key about 1% of absent keys pass. Beside the fences of a run (the first
key of each chunk) the filter keeps the run's RAM under ``_RAM_PER_KEY`` bytes per key.

A segment's filter is cut in blocks, one per ``FILTER_BLOCK_CHUNKS`` chunks of rows: a key's block
follows from its chunk (which the fences give), and a block is built and written as soon as its
rows are, so a segment of any size is written in bounded memory (:func:`block_words`,
:func:`blocks_may_contain`). A one-block filter is the same with a single block (:func:`bloom_build`,
:func:`bloom_add`, :func:`bloom_may_contain`).

The compiled core (:mod:`hierps.storage._native`) sets and probes the bits in one loop; the numpy
code here is the reference it is tested against, and serves without it.
"""

from __future__ import annotations

import numpy as np

from hierps.rows._initializers import splitmix64
from hierps.storage import _native

__all__ = [
    "FILTER_BLOCK_CHUNKS",
    "block_words",
    "blocks_may_contain",
    "bloom_add",
    "bloom_build",
    "bloom_may_contain",
    "filter_bits",
    "filter_words",
]

_FILTER_BITS = 12  # Bloom filter bits per key: ~1% false positives (fewer for wide rows, see below)
_RAM_PER_KEY = 1.9  # bytes of fences and filter per key a run may hold in RAM
_FILTER_PROBES = 6  # bits set per key, all in one 64-bit word (one cache line per probe)
FILTER_BLOCK_CHUNKS = 2048


def filter_bits(chunk_rows: int) -> int:
    """Filter bits per key: 12, or fewer where wide rows (few rows per chunk, so more fences per key:
    one per ``chunk_rows``) would take the fences and filter over ``_RAM_PER_KEY``."""
    return min(_FILTER_BITS, int((_RAM_PER_KEY - 8 / chunk_rows) * 8))


def filter_words(n: int, chunk_rows: int = 1 << 30) -> int:
    """Filter words for ``n`` keys of a run in chunks of ``chunk_rows`` rows."""
    return max(1, (n * filter_bits(chunk_rows) + 63) // 64)


block_words = filter_words  # the words of one block of a segment's filter: the same rule


def _probes(
    keys: np.ndarray, first_word: np.ndarray | int, words: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """keys (n,) int64 and their blocks' (first word, word count) -> (word of each key (n,) int64,
    the bits it sets there (n,) uint64)."""
    with np.errstate(over="ignore"):
        h = splitmix64(np.ascontiguousarray(keys, np.int64).view(np.uint64))
        word = ((h >> np.uint64(32)) * np.asarray(words).astype(np.uint64)) >> np.uint64(32)
        h2 = splitmix64(h)
    mask = np.zeros(len(keys), np.uint64)
    for i in range(_FILTER_PROBES):
        mask |= np.uint64(1) << ((h2 >> np.uint64(6 * i)) & np.uint64(63))
    return first_word + word.astype(np.int64), mask


def bloom_build(keys: np.ndarray, n_words: int | None = None) -> np.ndarray:
    """A one-block filter of ``keys`` (n,) int64: (w,) uint64 words."""
    words = np.zeros(n_words if n_words is not None else filter_words(len(keys)), np.uint64)
    bloom_add(words, keys)
    return words


def bloom_add(words: np.ndarray, keys: np.ndarray) -> None:
    """Set the bits of ``keys`` in the one-block filter ``words`` ((w,) uint64, contiguous)."""
    if len(keys) and _native.enabled() and words.flags.c_contiguous and words.dtype == np.uint64:
        _native.bloom_add(words, np.ascontiguousarray(keys, np.int64))
    elif len(keys):
        word, mask = _probes(keys, 0, len(words))
        np.bitwise_or.at(words, word, mask)


def bloom_may_contain(words: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """keys (n,) int64 -> (n,) bool: False where the one-block filter ``words`` proves a key absent."""
    if _native.enabled():
        out = np.empty(len(keys), bool)
        _native.bloom_may_contain(
            np.ascontiguousarray(words, np.uint64), np.ascontiguousarray(keys, np.int64), None, 1, out
        )
        return out
    word, mask = _probes(keys, 0, len(words))
    return (words[word] & mask) == mask


def blocks_may_contain(filt: np.ndarray, keys: np.ndarray, block: np.ndarray, full_words: int) -> np.ndarray:
    """keys (n,) int64 in blocks ``block`` (n,) of ``full_words`` words each (the last block: what is
    left of ``filt``) -> (n,) bool: False where the filter proves a key absent."""
    if _native.enabled():
        out = np.empty(len(keys), bool)
        _native.bloom_may_contain(
            np.ascontiguousarray(filt, np.uint64),
            np.ascontiguousarray(keys, np.int64),
            np.ascontiguousarray(block, np.int64),
            full_words,
            out,
        )
        return out
    first = block * full_words
    last_first = (len(filt) - 1) // full_words * full_words
    words = np.where(first >= last_first, len(filt) - first, full_words)
    word, mask = _probes(keys, first, words)
    return (filt[word] & mask) == mask
