"""Rows for keys never seen before, from (seed, table, key) alone.

A counter-based generator (splitmix64 over the triple and the column) makes a key's initial row
independent of the order, batch or tier in which the key first appears, so results never depend
on how the work was split into passes, mini-batches or ranks.
"""

from __future__ import annotations

import zlib

import numpy as np

from hierps.config import InitializerConfig

__all__ = ["initial_rows", "key_uniform", "splitmix64", "table_salt"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_TWO_PI = 2.0 * np.pi


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    """The splitmix64 finaliser, a bijection on uint64: ints (any shape) -> uint64 of that shape.

    Signed ints are read as their two's-complement bits (``-1`` as ``2**64 - 1``); a uint64 array
    is not copied.
    """
    z = np.asarray(x)
    z = z.view(np.uint64) if z.dtype == np.int64 else z.astype(np.uint64, copy=False)
    # Wrap-around on overflow is exactly the arithmetic wanted; numpy only warns for 0-d input.
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def table_salt(seed: int, table: str) -> np.uint64:
    """A 64-bit salt for one table of one store: stable across processes and Python versions."""
    crc = zlib.crc32(table.encode("utf-8"))
    mixed = splitmix64(np.array([(seed & 0xFFFFFFFF) << 32 | crc], dtype=np.uint64))
    return mixed[0]


def _uniform01(keys: np.ndarray, salt: np.uint64, columns: int, stream: int) -> np.ndarray:
    """(N, columns) float64 uniforms in (0, 1), one independent stream per (key, column, stream)."""
    with np.errstate(over="ignore"):
        base = splitmix64(keys.astype(np.int64).view(np.uint64) ^ salt)
        col = np.arange(1, columns + 1, dtype=np.uint64) * np.uint64(2 * stream + 1) * _GOLDEN
        bits = splitmix64(base[:, None] + col[None, :])
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def key_uniform(keys: np.ndarray, salt: np.uint64, draw: np.ndarray, stream: int) -> np.ndarray:
    """One uniform in (0, 1) per key: keys (N,) int64, draw (N,) int64 (which draw of that key) -> (N,) float64.

    ``stream`` separates uses (the initializer uses streams 0 and 1 through its own columns).
    """
    with np.errstate(over="ignore"):
        base = splitmix64(keys.astype(np.int64).view(np.uint64) ^ salt ^ (np.uint64(stream) * _MUL1))
        bits = splitmix64(base + draw.astype(np.int64).view(np.uint64) * _GOLDEN)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def initial_rows(keys: np.ndarray, dim: int, salt: np.uint64, init: InitializerConfig) -> np.ndarray:
    """keys: (N,) int64 -> (N, dim) float32 initial embedding rows."""
    n = int(keys.shape[0])
    if init.type == "zeros" or n == 0:
        return np.zeros((n, dim), dtype=np.float32)
    if init.type == "uniform":
        lo, hi = init.params["low"], init.params["high"]
        return (lo + (hi - lo) * _uniform01(keys, salt, dim, 0)).astype(np.float32)
    # Box-Muller: two uniform streams per value.
    u1 = _uniform01(keys, salt, dim, 0)
    u2 = _uniform01(keys, salt, dim, 1)
    normal = np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)
    return (init.params["mean"] + init.params["std"] * normal).astype(np.float32)
