"""A table's features one by one: admission of new keys, sightings in counters, eviction.

:class:`Features` is what the training path needs of the feature life cycle: a training gather
asks it which keys earn a row (:meth:`Features.admit`), what keys without one read as, and counts
sightings into resident rows; the end of a pass asks it to evict what a table's
:class:`~hierps.config.EvictionConfig` condemns (:meth:`Features.shrink_table`). The public side
(``observe``, ``shrink``, ``export``) is :class:`hierps.lifecycle._lifecycle.FeatureLifeCycle`.
"""

from __future__ import annotations

import numpy as np
import torch

from hierps._core import StoreCore
from hierps.config import EvictionConfig
from hierps.lifecycle._admission import admitted
from hierps.rows._counters import condemned, record_seen
from hierps.rows._ids import distinct
from hierps.rows._initializers import initial_rows
from hierps.rows._table import TableInfo

__all__ = ["Features"]


class Features:
    """Admission, sightings and eviction of the rows of a store's tables."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def admit(
        self, info: TableInfo, keys: np.ndarray, n_seen: np.ndarray, candidates: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Count sightings of pending ``keys[candidates]``; -> (admitted now (U,) bool, earlier sightings (U,))."""
        new = np.zeros(len(keys), bool)
        prior = np.zeros(len(keys), np.int64)
        at = np.flatnonzero(candidates)
        if len(at) == 0:
            return new, prior
        pending = self._core.pending_keys[info.name]
        before, after = pending.see(keys[at], n_seen[at], self._core.passes)
        ok = admitted(info.admission, info.salt, keys[at], before, after)
        new[at[ok]] = True
        prior[at[ok]] = before[ok]
        pending.remove(keys[at[ok]])
        pending.bound()
        return new, prior

    def unadmitted_weights(self, info: TableInfo, keys: np.ndarray) -> np.ndarray:
        """What keys without a row read as: keys (n,) int64 -> (n, dim) float32."""
        if info.admission.unknown_rows == "zeros":
            return np.zeros((len(keys), info.dim), np.float32)
        return initial_rows(keys, info.dim, info.salt, info.initializer)

    def count_seen(self, info: TableInfo, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Add sightings (counts (U,), default 1 each) to the counters of resident rows at ``slots``."""
        n = (
            counts.to(torch.float32)
            if counts is not None
            else torch.ones(len(slots), device=self._core.device)
        )
        record_seen(
            self._core.device_tier.rows(info.name),
            slots,
            info.counter_word,
            n,
            self._core.passes,
            info.eviction.decay,
        )
        self._core.device_tier.mark_dirty(info.name, slots)

    def shrink_table(self, info: TableInfo, rule: EvictionConfig) -> int:
        """Delete the rows of one table that ``rule`` condemns; returns how many (see
        :meth:`hierps.lifecycle._lifecycle.FeatureLifeCycle.shrink`)."""
        self._core.write_back()
        if not rule.active:
            return 0
        name, cols = info.name, slice(info.counter_word, info.words)
        mem_keys, mem_counters = self._core.memory.columns(name, cols)
        doomed = [mem_keys[condemned(mem_counters, self._core.passes, rule)]]
        for keys, block in self._core.ssd.scan(name, cols):
            older = ~self._core.memory.contains(name, keys)  # a cached row is newer than its SSD copy
            doomed.append(keys[older][condemned(block[older], self._core.passes, rule)])
        gone = distinct(np.concatenate(doomed))
        if len(gone):
            # The SSD first: a deletion the disk refuses changes nothing there, and the RAM tier
            # still holds the newest rows, so no older SSD copy of a condemned key reappears.
            self._core.ssd.delete(name, gone)  # rewrites the segments that held them
            self._core.memory.discard(name, gone)
        if rule.ttl_passes is not None:
            self._core.pending_keys[name].prune(self._core.passes - rule.ttl_passes)
        return int(len(gone))
