"""The life of a feature in a store: sightings and counters, admission, shrinking, export.

:class:`LifeCycle` is the part of :class:`hierps.Store` that follows keys through their life
(the store inherits it; it is not used on its own):

- every training gather counts the sightings of its keys into their rows' counters
  (:mod:`hierps.counters`), and :meth:`LifeCycle.observe` counts impressions and clicks;
- under a table's :class:`~hierps.config.AdmissionConfig` a key without a row is pending until
  it earns one (:mod:`hierps.admission`);
- :meth:`LifeCycle.shrink` deletes rows that the table's :class:`~hierps.config.EvictionConfig`
  condemns, from every tier and, through compaction, from the disk;
- :meth:`LifeCycle.export` writes a checkpoint's weights, or a delta, for serving
  (:mod:`hierps.export`, read back by :mod:`hierps.serving`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hierps import ids as _ids
from hierps.admission import PendingKeys, admitted
from hierps.config import EvictionConfig
from hierps.counters import CLICK, COUNT, DECAYED, LAST_PASS, SHOW, condemned, record_seen
from hierps.errors import ConfigError
from hierps.initializers import initial_rows

if TYPE_CHECKING:
    from hierps.store import TableInfo
    from hierps.tiers import DeviceTier, MemoryTier, SsdTier

__all__ = ["LifeCycle"]


class LifeCycle:
    """Counters, admission, shrinking and export of a :class:`hierps.Store` (its base class)."""

    if TYPE_CHECKING:  # what the store provides
        path: Path
        device: torch.device
        passes: int
        max_segments: int
        tables: dict[str, TableInfo]
        pending_keys: dict[str, PendingKeys]
        device_tier: DeviceTier
        memory: MemoryTier
        ssd: SsdTier
        _pending: list[Any]

        def _check_open(self) -> None: ...
        def _info(self, table: str) -> TableInfo: ...
        def _whole_rows(self, table: str, keys: Any) -> np.ndarray: ...
        def _resident_slots(self, table: str, keys: torch.Tensor) -> torch.Tensor: ...
        def _write_back(self) -> None: ...

    def counters(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """The counters of int64 ``keys`` (n,): ``{"count", "decayed", "show", "click", "last_pass"}`` ->
        (n,) float32 each (keys without a row: nothing seen; ``decayed`` is as of ``last_pass``)."""
        block = self._whole_rows(table, keys)[:, self._info(table).state_end :]
        return {
            "count": block[:, COUNT],
            "decayed": block[:, DECAYED],
            "show": block[:, SHOW],
            "click": block[:, CLICK],
            "last_pass": block[:, LAST_PASS],
        }

    def _admit(
        self, info: TableInfo, keys: np.ndarray, n_seen: np.ndarray, candidates: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Count sightings of pending ``keys[candidates]``; -> (admitted now (U,) bool, earlier sightings (U,))."""
        new = np.zeros(len(keys), bool)
        prior = np.zeros(len(keys), np.int64)
        at = np.flatnonzero(candidates)
        if len(at) == 0:
            return new, prior
        pending = self.pending_keys[info.name]
        before, after = pending.see(keys[at], n_seen[at], self.passes)
        ok = admitted(info.admission, info.salt, keys[at], before, after)
        new[at[ok]] = True
        prior[at[ok]] = before[ok]
        pending.remove(keys[at[ok]])
        pending.bound()
        return new, prior

    def _unadmitted_weights(self, info: TableInfo, keys: np.ndarray) -> np.ndarray:
        """What keys without a row read as: keys (n,) int64 -> (n, dim) float32."""
        if info.admission.unknown_rows == "zeros":
            return np.zeros((len(keys), info.dim), np.float32)
        return initial_rows(keys, info.dim, info.salt, info.initializer)

    def _count_seen(self, info: TableInfo, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Add sightings (counts (U,), default 1 each) to the counters of resident rows at ``slots``."""
        n = counts.to(torch.float32) if counts is not None else torch.ones(len(slots), device=self.device)
        record_seen(
            self.device_tier.rows(info.name), slots, info.state_end, n, self.passes, info.eviction.decay
        )
        self.device_tier.mark_dirty(info.name, slots)

    def _stored(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) bool: True where the RAM or SSD tier holds a row."""
        self._pipe.wait_writebacks()  # a row on its way down is in no tier for a moment
        with self._pipe.lock:
            found = self.memory.contains(table, keys)
            return found | self.ssd.index[table].lookup(keys)[0]

    def _has_row(self, table: str, keys: np.ndarray) -> np.ndarray:
        """keys (n,) int64 -> (n,) bool: True where any tier holds a row."""
        found, _ = self.device_tier.resolve(table, torch.from_numpy(keys).to(self.device))
        return found.cpu().numpy() | self._stored(table, keys)

    def has_rows(self, table: str, ids: Any) -> np.ndarray:
        """ids: (n,) int64 -> (n,) bool, True for keys that have a row in some tier (admitted, not deleted)."""
        self._check_open()
        self._info(table)
        return self._has_row(table, _ids.as_int64_array(ids, what=f"ids for table {table!r}"))

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions (and clicks) of keys into their rows' ``show`` / ``click`` counters.

        ids: (N,) int64, one entry per occurrence of a key in an example; clicks: (N,) float
        labels of those examples (1 click, 0 none) or None for impressions only. Keys without a
        row (pending admission) are not counted. Call it once per training mini-batch, e.g. with
        the ids of the batch and each example's label repeated over its ids.
        """
        self._check_open()
        info = self._info(table)
        keys = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
        labels = None
        if clicks is not None:
            labels = clicks.detach().cpu().numpy() if isinstance(clicks, torch.Tensor) else np.asarray(clicks)
            labels = labels.reshape(-1).astype(np.float64)
            if labels.shape != keys.shape:
                raise ConfigError(
                    f"observe on {table!r}: {labels.size} clicks for {keys.size} ids; pass one "
                    "click label per id (repeat each example's label over its ids)."
                )
        uniq, inverse = np.unique(keys, return_inverse=True)
        shows = np.bincount(inverse, minlength=len(uniq)).astype(np.float32)
        clicked = (
            np.bincount(inverse, weights=labels, minlength=len(uniq)).astype(np.float32)
            if labels is not None
            else np.zeros(len(uniq), np.float32)
        )
        has = np.flatnonzero(self._has_row(table, uniq)) if len(uniq) else np.empty(0, np.int64)
        if len(has) == 0:
            return
        slots = self._resident_slots(table, torch.from_numpy(uniq[has]).to(self.device))
        resident = self.device_tier.rows(table)
        resident[:, info.state_end + SHOW].index_add_(0, slots, torch.from_numpy(shows[has]).to(self.device))
        resident[:, info.state_end + CLICK].index_add_(
            0, slots, torch.from_numpy(clicked[has]).to(self.device)
        )
        self.device_tier.mark_dirty(table, slots)

    def shrink(
        self,
        table: str | None = None,
        *,
        ttl_passes: int | None = None,
        min_decayed_count: float | None = None,
    ) -> dict[str, int]:
        """Delete the rows eviction condemns from every tier; returns ``{table: rows deleted}``.

        A row goes when unseen for ``ttl_passes`` finished passes, or when its decayed count is
        under ``min_decayed_count``: the table's :class:`~hierps.config.EvictionConfig`, which
        these arguments override for this call. The working set is written back first. SSD
        segments that held deleted rows are rewritten without them (unless ``reclaim_disk`` is
        off), so the rows leave the disk once no kept checkpoint names those segments. Pending
        keys unseen for ``ttl_passes`` are forgotten too. Reads the counters of every row of the
        table: run it every few passes.
        """
        self._check_open()
        self._pipe.drain()  # the tiers below must be quiet while rows are condemned
        if self._pending:
            raise ConfigError(
                "shrink: rows were gathered for an optimizer step that has not run; call "
                "store.step() or store.zero_grad() first, then shrink."
            )
        names = [table] if table is not None else list(self.tables)
        for name in names:
            self._info(name)
        overrides = {
            k: v
            for k, v in (("ttl_passes", ttl_passes), ("min_decayed_count", min_decayed_count))
            if v is not None
        }
        return {
            name: self._shrink(self.tables[name], replace(self.tables[name].eviction, **overrides))
            for name in names
        }

    def _shrink(self, info: TableInfo, rule: EvictionConfig) -> int:
        """Delete the rows of one table that ``rule`` condemns; returns how many (see :meth:`shrink`)."""
        self._write_back()
        if not rule.active:
            return 0
        name, cols = info.name, slice(info.state_end, info.width)
        mem_keys, mem_counters = self.memory.columns(name, cols)
        doomed = [mem_keys[condemned(mem_counters, self.passes, rule)]]
        for keys, block in self.ssd.scan(name, cols):
            older = ~self.memory.contains(name, keys)  # a cached row is newer than its SSD copy
            doomed.append(keys[older][condemned(block[older], self.passes, rule)])
        gone = np.unique(np.concatenate(doomed))
        if len(gone):
            segments = self.ssd.segments_holding(name, gone)
            self.memory.discard(name, gone)
            self.ssd.delete(name, gone)
            self.ssd.compact(name, self.max_segments, rewrite=segments if rule.reclaim_disk else ())
        if rule.ttl_passes is not None:
            self.pending_keys[name].prune(self.passes - rule.ttl_passes)
        return int(len(gone))

    def num_pending(self, table: str) -> int:
        """Keys of ``table`` counted while waiting for admission (they have no row)."""
        self._info(table)
        return len(self.pending_keys[table])

    def export(self, path: str | os.PathLike[str], since: int | str | None = None) -> dict[str, Any]:
        """Write the weights of the latest checkpoint for serving; returns the export's manifest.

        ``since`` (a checkpoint id or tag this store still keeps) makes it a delta: only rows
        changed since that checkpoint, and the keys deleted. The export is a plain Zarr v3 group
        (see :mod:`hierps.export`); rows trained after the latest checkpoint are not in it, so
        call :meth:`checkpoint` first.
        """
        from hierps.export import export_store

        self._check_open()
        return export_store(self.path, path, since=since)
