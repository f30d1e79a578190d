"""The life of a feature in a store: sightings and counters, admission, shrinking, export.

:class:`FeatureLifeCycle` is the part of :class:`hierps.Store` that follows keys through their
life (on :class:`~hierps.lifecycle._features.Features`, which the training path uses too):

- every training gather counts the sightings of its keys into their rows' counters
  (:mod:`hierps.rows._counters`), and :meth:`FeatureLifeCycle.observe` counts impressions and clicks;
- under a table's :class:`~hierps.config.AdmissionConfig` a key without a row is pending until
  it earns one (:mod:`hierps.lifecycle._admission`);
- :meth:`FeatureLifeCycle.shrink` deletes rows that the table's :class:`~hierps.config.EvictionConfig`
  condemns, from every tier and, through compaction, from the disk;
- :meth:`FeatureLifeCycle.export` writes a checkpoint's weights, or a delta, for serving
  (:mod:`hierps.lifecycle._export`, read back by :mod:`hierps.serving`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from hierps._core import StoreCore
from hierps.config import EvictionConfig
from hierps.errors import ConfigError
from hierps.lifecycle._features import Features
from hierps.rows import _ids
from hierps.rows._counters import CLICK, COUNT, DECAYED, LAST_PASS, SHOW

__all__ = ["FeatureLifeCycle", "SlotSource", "observation"]


class SlotSource(Protocol):
    """What :meth:`FeatureLifeCycle.observe` needs of the pass runner: rows made resident."""

    def resident_slots(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """keys: (U,) sorted unique int64 on the device -> their slots in the device tier."""
        ...


class FeatureLifeCycle:
    """Counters, admission, shrinking and export: the public side of a store's feature life cycle."""

    def __init__(self, core: StoreCore, features: Features, slots: SlotSource) -> None:
        self._core = core
        self._features = features
        self._slots = slots

    def counters(self, table: str, keys: Any) -> dict[str, np.ndarray]:
        """The counters of int64 ``keys`` (n,): ``{"count", "decayed", "show", "click", "last_pass"}`` ->
        (n,) float32 each (keys without a row: nothing seen; ``decayed`` is as of ``last_pass``)."""
        block = self._core.whole_rows(table, keys)[:, self._core.info(table).state_end :]
        return {
            "count": block[:, COUNT],
            "decayed": block[:, DECAYED],
            "show": block[:, SHOW],
            "click": block[:, CLICK],
            "last_pass": block[:, LAST_PASS],
        }

    def has_rows(self, table: str, ids: Any) -> np.ndarray:
        """ids: (n,) int64 -> (n,) bool, True for keys that have a row in some tier (admitted, not deleted)."""
        self._core.check_open()
        self._core.info(table)
        return self._core.has_row(table, _ids.as_int64_array(ids, what=f"ids for table {table!r}"))

    def observe(self, table: str, ids: Any, clicks: Any = None) -> None:
        """Count impressions (and clicks) of keys into their rows' ``show`` / ``click`` counters.

        ids: (N,) int64, one entry per occurrence of a key in an example; clicks: (N,) float
        labels of those examples (1 click, 0 none) or None for impressions only. Keys without a
        row (pending admission) are not counted. Call it once per training mini-batch, e.g. with
        the ids of the batch and each example's label repeated over its ids.
        """
        self._core.check_open()
        self._core.info(table)
        self.observe_counts(table, *observation(table, ids, clicks))

    def observe_counts(self, table: str, keys: np.ndarray, shows: np.ndarray, clicks: np.ndarray) -> None:
        """Add ``shows`` and ``clicks`` (n,) to the counters of int64 ``keys`` (n,), repeats summed first.

        What :meth:`observe` does once it has counted its ids; the owner's side of a sharded
        observe, whose keys come from several ranks. Keys without a row are not counted.
        """
        self._core.check_open()
        info = self._core.info(table)
        if len(keys) == 0:
            return
        uniq, inverse = np.unique(keys, return_inverse=True)
        summed = [
            np.bincount(inverse, weights=np.asarray(v, np.float64), minlength=len(uniq)).astype(np.float32)
            for v in (shows, clicks)
        ]
        has = np.flatnonzero(self._core.has_row(table, uniq))
        if len(has) == 0:
            return
        slots = self._slots.resident_slots(table, torch.from_numpy(uniq[has]).to(self._core.device))
        resident = self._core.device_tier.rows(table)
        for column, values in zip((SHOW, CLICK), summed):
            resident[:, info.counter_word + column].index_add_(
                0, slots, torch.from_numpy(values[has]).to(self._core.device)
            )
        self._core.device_tier.mark_dirty(table, slots)

    def shrink(
        self, table: str | None, ttl_passes: int | None, min_decayed_count: float | None
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
        self._core.check_open()
        self._core.pipe.drain()  # the tiers below must be quiet while rows are condemned
        names = [table] if table is not None else list(self._core.tables)
        for name in names:
            self._core.info(name)
        return {
            name: self._features.shrink_table(
                self._core.tables[name],
                _overridden(self._core.tables[name].eviction, ttl_passes, min_decayed_count),
            )
            for name in names
        }

    def num_pending(self, table: str) -> int:
        """Keys of ``table`` counted while waiting for admission (they have no row)."""
        self._core.info(table)
        return len(self._core.pending_keys[table])

    def export(
        self, path: str | os.PathLike[str], since: int | str | None = None, dtype: str = "fp32"
    ) -> dict[str, Any]:
        """Write the weights of the latest checkpoint for serving; returns the export's manifest.

        ``since`` (a checkpoint id or tag this store still keeps) makes it a delta: only rows
        changed since that checkpoint, and the keys deleted. The export is a plain Zarr v3 group
        (see :mod:`hierps.lifecycle._export`); rows trained after the latest checkpoint are not in it, so
        call :meth:`checkpoint` first. ``dtype="fp16"`` stores the weights in float16 (half the
        bytes, rounded to nearest; any Zarr reader opens them); serving returns them as float32.
        """
        from hierps.lifecycle._export import export_store

        self._core.check_open()
        return export_store(self._core.path, path, since=since, dtype=dtype)


def observation(table: str, ids: Any, clicks: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arguments of :meth:`FeatureLifeCycle.observe` -> (keys (N,) int64, shows (N,) float32 ones,
    clicks (N,) float64), checked: one click label per id, each 0 or 1 (an id is one impression,
    clicked or not), or None for impressions only."""
    keys = _ids.as_int64_array(ids, what=f"ids for table {table!r}")
    labels = np.zeros(len(keys))
    if clicks is not None:
        try:
            labels = clicks.detach().cpu().numpy() if isinstance(clicks, torch.Tensor) else np.asarray(clicks)
            labels = labels.reshape(-1).astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"observe on {table!r}: clicks must be numbers, 0 or 1 per id. Got {type(clicks).__name__} ({exc})."
            ) from exc
        if labels.shape != keys.shape:
            raise ConfigError(
                f"observe on {table!r}: {labels.size} clicks for {keys.size} ids; pass one "
                "click label per id (repeat each example's label over its ids)."
            )
        wrong = np.flatnonzero((labels != 0) & (labels != 1))
        if len(wrong):
            raise ConfigError(
                f"observe on {table!r}: click label {float(labels[wrong[0]])} for id {int(keys[wrong[0]])} (entry "
                f"{int(wrong[0])}); each id is one impression, clicked (1) or not (0). Count an example "
                "seen several times by repeating its ids, one label each."
            )
    return keys, np.ones(len(keys), np.float32), labels


def _overridden(
    rule: EvictionConfig, ttl_passes: int | None, min_decayed_count: float | None
) -> EvictionConfig:
    """``rule`` with the arguments of one :meth:`FeatureLifeCycle.shrink` call in place of its own."""
    if ttl_passes is not None:
        rule = replace(rule, ttl_passes=ttl_passes)
    if min_decayed_count is not None:
        rule = replace(rule, min_decayed_count=min_decayed_count)
    return rule
