"""Where a key's row is in the device tier, found by hashing: the tier's index on the CPU.

The device tier (:mod:`hierps.tiers._device`) finds a mini-batch's ids among a table's resident
keys. On a GPU it searches a sorted key tensor on the device; on the CPU, where the tier's tensors
are host memory, a :class:`SlotIndex` (an open-addressing hash table run by the compiled core,
:func:`hierps.storage._native.slot_find` / ``slot_put``) answers in time proportional to the ids
asked for, and a row made resident costs one entry, not a merge into every resident key. So a tier
used as a cache (rows fetched on demand, no pass announced) pays per step for the ids it sees,
whatever it holds. Where the compiled core is missing the tier keeps its sorted index.
"""

from __future__ import annotations

import numpy as np
import torch

from hierps.storage import _native

__all__ = ["NATIVE_UNIQUE_MAX", "SlotIndex", "distinct_ids", "hashed"]

_MIN_CAPACITY = 64
# Lookups of up to this many ids deduplicate in the compiled core (a hash table, then a radix sort
# of the distinct ids only): 1.5-2x faster than torch.unique at a mini-batch's few hundred ids (a
# small-batch model pays a forward's fixed costs per table), 2-4x at 10^4; past ~2x10^4 ids its
# table leaves the cache and torch.unique's sort is faster.
NATIVE_UNIQUE_MAX = 1 << 14


def hashed() -> bool:
    """Whether a CPU device tier indexes its keys with a :class:`SlotIndex` (the compiled core serves)."""
    return _native.enabled()


class SlotIndex:
    """key -> slot for int64 keys: ``(2 * cap,)`` int64 entries ``(key, slot + 1)``, at most half full."""

    def __init__(self, keys: np.ndarray | None = None, slots: np.ndarray | None = None) -> None:
        self.n = 0
        self._table = np.zeros(2 * _MIN_CAPACITY, np.int64)
        if keys is not None and slots is not None and len(keys):
            self.put(keys, slots)

    @property
    def capacity(self) -> int:
        return len(self._table) // 2

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 -> (found (n,) bool, slots (n,) int64: the slot where found, else 0)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        slots = np.empty(len(keys), np.int64)
        found = np.empty(len(keys), bool)
        _native.slot_find(self._table, keys, slots, found)
        return found, slots

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """keys (n,) int64 -> (slots (n,) int64, valid where found; found (n,) bool, or None when
        every key is here): one probe each, whether all are here or not."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        slots = np.empty(len(keys), np.int64)
        found = np.empty(len(keys), bool)
        return slots, None if _native.slot_find(self._table, keys, slots, found) == len(keys) else found

    def put(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Each of distinct ``keys`` (n,) int64 now at ``slots[i]`` (n,) int64 >= 0 (added, or moved)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if 2 * (self.n + len(keys)) > self.capacity:
            self._grow(self.n + len(keys))
        self.n += _native.slot_put(self._table, self.n, keys, slots)

    def drop(self, keys: np.ndarray) -> None:
        """Forget distinct ``keys`` (n,) int64 (those absent are ignored): rows that left the tier."""
        self.n -= _native.slot_drop(self._table, np.ascontiguousarray(keys, dtype=np.int64))

    def _grow(self, n: int) -> None:
        cap = _MIN_CAPACITY
        while 4 * n > cap:  # a quarter full: room for as many again before the next growth
            cap *= 2
        old = self._table.reshape(-1, 2)
        held = old[old[:, 1] != 0]
        self._table = np.zeros(2 * cap, np.int64)
        self.n = 0
        if len(held):
            self.n = _native.slot_put(self._table, 0, np.ascontiguousarray(held[:, 0]), held[:, 1] - 1)


def distinct_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (...) int64 -> (sorted distinct ids (U,), each id's position among them (...), counts (U,)):
    ``torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)``, the same integers."""
    if ids.device.type == "cpu" and ids.numel() <= NATIVE_UNIQUE_MAX and _native.enabled():
        keys, inverse, counts = _native.unique_ids(ids.contiguous().view(-1).numpy())
        return torch.from_numpy(keys), torch.from_numpy(inverse).view(ids.shape), torch.from_numpy(counts)
    keys, inverse, counts = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
    return keys, inverse, counts
