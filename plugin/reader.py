"""Read-only access to one checkpoint of a store directory, without opening the store.

Used by serving, export, inspection and resharding: it takes no lock and writes nothing, so it
may run while another process trains in the same directory (it sees a committed checkpoint, never
a half-written one, because checkpoints are immutable once their manifest exists).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hierps._files import read_json_checked
from hierps.admission import PENDING_ARRAYS
from hierps.checkpoint import CheckpointCatalog
from hierps.counters import NUM_COUNTERS
from hierps.errors import ConfigError, StoreFormatError
from hierps.store import FORMAT_VERSION
from hierps.tiers.ssd import SsdTier, TableIndex

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """Rows of every table as of one checkpoint (``ref``: id, tag, or None for the latest)."""

    def __init__(self, path: str | os.PathLike[str], ref: int | str | None = None) -> None:
        self.path = Path(path)
        marker = self.path / "hierps.json"
        if not marker.exists():
            raise StoreFormatError(f"{self.path}: is not a hierps store (no hierps.json).")
        read_json_checked(marker)
        self.catalog = CheckpointCatalog(self.path / "checkpoints")
        ckpt = self.catalog.latest() if ref is None else self.catalog.find(ref)
        if ckpt is None:
            raise ConfigError(f"{self.path}: no checkpoint {ref!r}; it has ids {self.catalog.ids()}.")
        self.checkpoint_id = ckpt
        self.manifest: dict[str, Any] = self.catalog.manifest(ckpt)
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.path}: checkpoint {ckpt} has format version {self.manifest.get('format_version')!r}; this "
                f"hierps reads {FORMAT_VERSION}. Read it with a matching hierps release."
            )
        self._ssd = SsdTier(self.path / "segments")
        for name, meta in self.manifest["tables"].items():
            sizes = {int(s): int(n) for s, n in meta["segments"].items()}
            self._ssd.load_index(name, int(meta["width"]), self.catalog.read_index(ckpt, name), sizes)

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        """``{name: {"dim", "width", "optimizer", "initializer", "step", "rows", "segments"}}``."""
        return self.manifest["tables"]

    def keys(self, table: str) -> np.ndarray:
        """(n,) int64 sorted keys stored for ``table``."""
        return self._ssd.index[self._check(table)].keys

    def index(self, table: str) -> TableIndex:
        """The key index of ``table``: where each key's row lies (segment, position); do not modify."""
        return self._ssd.index[self._check(table)]

    def scan_counters(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64, counters (b, NUM_COUNTERS) float32)`` over every stored row."""
        width = int(self.tables[self._check(table)]["width"])
        yield from self._ssd.scan(table, slice(width - NUM_COUNTERS, width))

    def pending_keys(self, table: str) -> np.ndarray:
        """(p,) int64 keys of ``table`` that were pending admission (counted, without a row)."""
        arrays = self.catalog.read_extra(self.checkpoint_id, self._check(table), PENDING_ARRAYS)
        return np.empty(0, np.int64) if arrays is None else np.asarray(arrays[PENDING_ARRAYS[0]], np.int64)

    def read(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) int64 sorted unique -> (found (n,) bool, rows (found.sum(), width) float32)."""
        return self._ssd.read(self._check(table), np.asarray(keys, dtype=np.int64))

    def iter_rows(self, table: str, batch: int = 1 << 18) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys (b,) int64, rows (b, width) float32)`` over every stored row, by key."""
        keys = self.keys(table)
        for start in range(0, len(keys), batch):
            chunk = keys[start : start + batch]
            _, rows = self._ssd.read(table, chunk)
            yield chunk, rows

    def _check(self, table: str) -> str:
        if table not in self.manifest["tables"]:
            raise ConfigError(f"{self.path}: checkpoint {self.checkpoint_id} has no table {table!r}; "
                              f"it has {sorted(self.manifest['tables'])}.")
        return table
